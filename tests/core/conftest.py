"""Shared by the core tests: no secret a test saw may reach the logs; receipts writing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from gateway.core.push import Outcome, Receipt
from gateway.core.receipts import ReceiptsFormat, ReceiptWriter
from spark_plugins import synthetic


@pytest.fixture
def secrets_seen() -> set[str]:
    """Strings that must never show up in log output (tokens, JWTs, OAuth tokens)."""
    return set()


def logged_text(caplog: pytest.LogCaptureFixture) -> str:
    """Everything logged in a test's setup, call and teardown, messages of exceptions
    included. For fixtures checking after `yield`: there, `caplog.text` and
    `caplog.records` hold the teardown's records alone (pytest keeps one per phase)."""
    records = [r for when in ("setup", "call", "teardown") for r in caplog.get_records(when)]
    formatter = logging.Formatter()
    return "".join(formatter.format(r) + str(r.args) for r in records)


@pytest.fixture(autouse=True)
def no_secrets_in_logs(caplog: pytest.LogCaptureFixture, secrets_seen: set[str]) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    text = logged_text(caplog)
    for secret in secrets_seen:
        assert secret not in text


def nested(depth: int) -> dict[str, object]:
    """A JSON object `depth` levels deep, built without recursion."""
    value: dict[str, object] = {}
    for _ in range(depth):
        value = {"x": value}
    return value


async def write_groups(
    directory: Path,
    groups: Sequence[Sequence[Receipt]],
    *,
    file_format: ReceiptsFormat,
    roll_bytes: int = 64 * 1024 * 1024,
) -> None:
    """Write each group as one batch (the writer thread reports it), then close."""
    loop = asyncio.get_running_loop()
    written: asyncio.Queue[int] = asyncio.Queue()
    writer = ReceiptWriter(
        directory,
        roll_bytes=roll_bytes,
        file_format=file_format,
        on_written=lambda n: loop.call_soon_threadsafe(written.put_nowait, n),
    )
    await writer.start()
    for group in groups:
        for receipt in group:
            await writer.put(receipt)
        assert await written.get() == len(group)
    await writer.close()


def make_receipts(n: int, secrets_seen: set[str], seed: int = 7) -> list[Receipt]:
    """Varied receipts plus one with every nullable field null and a non-ASCII app id;
    their ids must not be logged."""
    items = list(synthetic.receipts(n - 1, seed=seed))
    items.append(
        Receipt(
            push_id="2b1f0c55-0000-4000-8000-000000000001",
            plugin="matrix",
            app_id="unknown.\u00fcber.\U0001f514",  # escaped in JSON, raw in Parquet
            provider=None,
            outcome=Outcome.PERMANENT,
            status=None,
            reason=None,
            attempts=0,
            latency=0.0001,
            finished_at=1_735_689_600.25,
            token_hash=None,
        )
    )
    for item in items:
        secrets_seen.add(item.push_id)
        if item.token_hash:
            secrets_seen.add(item.token_hash)
    return items
