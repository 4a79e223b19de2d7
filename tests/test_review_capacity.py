"""Capacity review: the figures of docs/sizing.md are measured again here, with the real
receipts writer, the real Zulip repository and token recorder, on SQLite and on
PostgreSQL, and each must stay within 25 % of the doc (bytes and rows only, no times).

The doc's figures table is the source: each row names a figure's key (the key
`bench/sizing.py` prints) in backticks and its bytes. A figure the doc states and this
test does not measure, or the other way round, fails too, so the doc and the
measurement cannot drift apart silently.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "sizing.md"
TOLERANCE = 0.25
RECEIPTS = 50_000  # per format: about a fifth of a 64 MiB file
ROWS = 1_500  # per kind of record


def _sizing() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pushgw_bench_sizing", ROOT / "bench/sizing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sizing = _sizing()


def doc_figures() -> dict[str, float]:
    """`| `key` | 1,234.5 | ...` rows of the doc's figures table."""
    figures: dict[str, float] = {}
    for match in re.finditer(
        r"^\| `([a-z_]+:[a-z0-9_.+]+)` \| ([\d,.]+) \|", DOC.read_text(), re.M
    ):
        key, value = match.group(1), float(match.group(2).replace(",", ""))
        assert key not in figures, f"{key} twice in docs/sizing.md"
        figures[key] = value
    return figures


def check(measured: dict[str, float], prefix: str) -> None:
    stated = {k.removeprefix(prefix): v for k, v in doc_figures().items() if k.startswith(prefix)}
    assert set(stated) == set(measured), (prefix, sorted(stated), sorted(measured))
    off = {
        key: (stated[key], round(value, 1))
        for key, value in measured.items()
        if abs(value - stated[key]) > TOLERANCE * stated[key]
    }
    assert not off, f"docs/sizing.md (stated, measured) more than 25 % apart: {off}"


def test_doc_is_linked_and_its_table_parses() -> None:
    assert "(docs/sizing.md)" in (ROOT / "README.md").read_text()
    prefixes = {key.split(":")[0] for key in doc_figures()}
    assert prefixes == {"receipt", "receipt_nohash", "buffer", "sqlite", "postgresql"}


async def test_receipt_bytes_per_push_match_the_doc() -> None:
    """JSON Lines and Parquet (and each gzipped) bytes per receipt, written by the real
    `ReceiptWriter` and published as it publishes them."""
    check(await sizing.receipt_bytes(RECEIPTS, hashed=True), "receipt:")
    check(await sizing.receipt_bytes(RECEIPTS, hashed=False), "receipt_nohash:")


def test_buffered_receipt_memory_matches_the_doc() -> None:
    check({"record": sizing.buffered_receipt_bytes()}, "buffer:")


async def test_database_bytes_per_registration_match_the_doc(store_url: str) -> None:
    """Bytes per row, table and indexes, of each table that grows with load: Zulip
    registrations (APNs and FCM tokens, E2EE and legacy), a Zulip server with its realm,
    a dead token's record; Matrix and Marmot keep none (below)."""
    dialect = "postgresql" if store_url.startswith("postgresql") else "sqlite"
    check(await sizing.database_bytes(store_url, ROWS), f"{dialect}:")


def test_matrix_and_marmot_keep_no_rows() -> None:
    """The doc's 0 bytes per registration for Matrix and Marmot: neither declares a
    table nor a migration branch (the only ways a plugin gets rows)."""
    from gateway.plugins import implemented_hooks
    from plugins.marmot import plugin as marmot
    from plugins.matrix import plugin as matrix
    from plugins.zulip import plugin as zulip

    assert {"pushgw_tables", "pushgw_migrations"} <= set(implemented_hooks(zulip))
    for module in (matrix, marmot):
        assert not {"pushgw_tables", "pushgw_migrations"} & set(implemented_hooks(module))
    text = DOC.read_text()
    assert "| Matrix | 0 |" in text and "| Marmot | 0 |" in text


@pytest.mark.parametrize("devices, pushes", [(1_000_000, 10_000_000)])
def test_worked_example_follows_from_the_table(devices: int, pushes: int) -> None:
    """The worked example's totals are the table's figures times the example's load."""
    figures = doc_figures()
    text = DOC.read_text()
    per_day_parquet = pushes * figures["receipt:parquet"] / 1e9
    per_day_jsonl = pushes * figures["receipt:jsonl"] / 1e9
    assert f"{per_day_parquet:.2f} GB a day" in text, per_day_parquet
    assert f"{per_day_jsonl:.2f} GB a day" in text, per_day_jsonl
    e2ee_pg = (
        devices * (figures["postgresql:zulip_e2ee.apns"] + figures["postgresql:zulip_e2ee.fcm"]) / 2
    )
    assert f"{e2ee_pg / 1e9:.2f} GB" in text, e2ee_pg
