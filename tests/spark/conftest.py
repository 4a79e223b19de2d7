"""Shared fixtures: one local SparkSession for the whole run, receipts from the real writer.

Spark tests skip with the reason when pyspark or Java 17 is missing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.core.push import Outcome, ProviderKind, Receipt
from spark_plugins import synthetic
from spark_plugins.session import spark_problem

START = 1_735_689_600.0  # 2025-01-01T00:00:00Z
HOURS = 48


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    problem = spark_problem()
    if problem:
        pytest.skip(f"Spark tests need pyspark and Java 17: {problem}")
    from spark_plugins.session import get_session

    session = get_session(
        "local[2]",
        app_name="pushgw-tests",
        conf={
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.memory": "2g",
            "spark.sql.shuffle.partitions": "4",
        },
    )
    yield session
    session.stop()


def receipt(
    ts: float,
    outcome: Outcome,
    *,
    token: str,
    plugin: str = "matrix",
    app_id: str = "im.vector.app.ios",
    provider: ProviderKind | None = ProviderKind.APNS,
    reason: str | None = None,
    attempts: int = 1,
    latency: float = 0.05,
) -> Receipt:
    return Receipt(
        push_id=str(uuid.uuid4()),
        plugin=plugin,
        app_id=app_id,
        provider=provider,
        outcome=outcome,
        status=200 if outcome is Outcome.OK else 500,
        reason=reason,
        attempts=attempts,
        latency=latency,
        finished_at=ts,
        token_hash=None if token == "" else synthetic.token_hash(token),
    )


def scenarios() -> list[Receipt]:
    """Hand-picked token histories (dead-token rules) and traffic bursts (anomalies)."""
    h = 3600.0
    t0 = START + 10 * h
    items = [
        # retired: ok, then BadDeviceToken twice
        receipt(t0, Outcome.OK, token="dead-perm"),
        receipt(t0 + h, Outcome.TOKEN_INVALID, token="dead-perm", reason="Unregistered"),
        receipt(t0 + 2 * h, Outcome.TOKEN_INVALID, token="dead-perm", reason="BadDeviceToken"),
        # alive: invalid, then ok again
        receipt(t0, Outcome.TOKEN_INVALID, token="revived", reason="BadDeviceToken"),
        receipt(t0 + h, Outcome.OK, token="revived"),
        # Marmot: no hash, never retired
        receipt(t0, Outcome.TOKEN_INVALID, token="", plugin="marmot", app_id="marmot.ios"),
    ]
    # retired: 6 transient failures over 30 hours after the last ok
    items.append(
        receipt(
            t0 - h,
            Outcome.OK,
            token="streak",
            plugin="zulip",
            app_id="zulip-android",
            provider=ProviderKind.FCM,
        )
    )
    items += [
        receipt(
            t0 + i * 6 * h,
            Outcome.TRANSIENT,
            token="streak",
            plugin="zulip",
            app_id="zulip-android",
            provider=ProviderKind.FCM,
            reason="UNAVAILABLE",
        )
        for i in range(6)
    ]
    # not retired: 6 failures within 2 hours (an outage), 4 failures (too few), refusals
    items += [receipt(t0 + i * 1200, Outcome.TRANSIENT, token="outage") for i in range(6)]
    items += [receipt(t0 + i * 8 * h, Outcome.TRANSIENT, token="few") for i in range(4)]
    items += [
        receipt(t0 + i * 6 * h, Outcome.TRANSIENT, token="refused", attempts=0, reason="queue_full")
        for i in range(6)
    ]
    # a matrix volume spike in hour 30 and a status failure spike in hour 40
    items += [receipt(START + 30 * h + i, Outcome.OK, token=f"burst-{i}") for i in range(400)]
    items += [
        receipt(
            START + 40 * h + i,
            Outcome.TRANSIENT,
            token=f"fail-{i}",
            plugin="status",
            app_id="im.status.ethereum",
            provider=ProviderKind.FCM,
            reason="INTERNAL",
        )
        for i in range(60)
    ]
    return items


@pytest.fixture(scope="session")
def receipts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~6,500 receipts written by the gateway's `ReceiptWriter`, rolled into several files."""
    directory = tmp_path_factory.mktemp("receipts")
    items = list(synthetic.receipts(6000, seed=3, start=START, hours=HOURS, tokens=400))
    synthetic.write_with_receipt_writer(items, directory, roll_bytes=300_000)
    # a second gateway node writing into a subdirectory: read recursively
    synthetic.write_with_receipt_writer(scenarios(), directory / "node-b")
    return directory
