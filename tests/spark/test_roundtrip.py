"""The dead-token round trip: a live gateway's receipts -> `dead-tokens` job ->
`pushgw tokens retire` -> the owning plugin's token-invalid hook, found by hash."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main as pushgw
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from spark_plugins import dead_tokens

pytestmark = pytest.mark.spark

FLAKY = "f1" * 32  # never answered: five transient failures in a row
HEALTHY = "e2" * 32
GONE = "d3" * 32  # dead at the provider: invalidated live, not again by retire


async def test_dead_token_round_trip(
    spark: Any, sample_plugin_installed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with ApnsSimulator() as apns:
        config = base_config(
            tmp_path,
            {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}},
            delivery={"max_retries": 0},  # one attempt per push: five receipts, five failures
        )
        apns.script(FLAKY, ApnsResponse.error("ServiceUnavailable"))
        apns.script(GONE, ApnsResponse.error("Unregistered"))
        async with GatewayHarness(config) as gw:
            for token in [FLAKY] * 5 + [HEALTHY] * 3 + [GONE]:
                response = await gw.client.post(
                    "/sample/push",
                    json={"app": "ios", "token": token, "payload": {"aps": {"alert": "x"}}},
                )
                assert response.status == 200
            context = gw.context("sample")
            live = [(i.token_hash, i.token) for i in context.state["invalid"]]
            flaky_hash, gone_hash = context.token_hash(FLAKY), context.token_hash(GONE)
        assert live == [(gone_hash, GONE)]  # only the provider's own verdict, so far

        out = tmp_path / "analytics"
        options = dead_tokens.JOB.resolve_options(["min_span_hours=0"])
        dead_tokens.JOB.run(spark, str(tmp_path / "receipts"), str(out), options)
        entries = [
            json.loads(line) for line in (out / "dead-tokens.jsonl").read_text().splitlines()
        ]
        by_hash = {e["token_hash"]: e for e in entries}
        assert set(by_hash) == {flaky_hash, gone_hash}
        assert by_hash[flaky_hash]["failures"] == 5 and by_hash[flaky_hash]["plugin"] == "sample"
        assert FLAKY not in (out / "dead-tokens.jsonl").read_text()

        config_file = tmp_path / "pushgw.yaml"
        config_file.write_text(yaml.safe_dump(config))
        status = await asyncio.to_thread(
            pushgw,
            ["tokens", "retire", str(out / "dead-tokens.jsonl"), "--config", str(config_file)],
        )
        assert status == 0
        assert "retired 2 tokens" in capsys.readouterr().out

    rows = (
        sqlite3.connect(tmp_path / "pushgw.db")
        .execute("SELECT token_hash, reason FROM sample_invalid ORDER BY reason")
        .fetchall()
    )
    # FLAKY reached the plugin only through retire, by its hash, with the job's reason
    assert [r for h, r in rows if h == flaky_hash] == ["consecutive_transient_failures"]
