"""Sizing figures: bytes per receipt, database bytes per registration, buffer memory.

    .venv/bin/python bench/sizing.py [--postgres postgresql+asyncpg://postgres@127.0.0.1/test]

Deterministic quantities only (bytes and rows, never times), measured with the real
code: receipts written by the gateway's `ReceiptWriter` (JSON Lines and Parquet),
registrations inserted by the Zulip plugin's own repository functions, dead tokens
recorded by the core's `TokenInvalidation`, into a fresh SQLite file and a fresh
PostgreSQL database migrated by `Store.upgrade` (the production schema, indexes
included). docs/sizing.md quotes the figures; tests/test_review_capacity.py measures
them again and fails when one drifts more than 25 % from the doc.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import secrets
import sys
import tempfile
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import text

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.core.metrics import Metrics  # noqa: E402
from gateway.core.push import InvalidToken, ProviderKind, Receipt  # noqa: E402
from gateway.core.receipts import ReceiptsFormat, ReceiptWriter, receipt_record  # noqa: E402
from gateway.core.store import Store  # noqa: E402
from gateway.core.tokens import TokenInvalidation  # noqa: E402
from plugins.zulip import repo  # noqa: E402
from plugins.zulip.plugin import pushgw_migrations as zulip_migrations  # noqa: E402
from spark_plugins import synthetic  # noqa: E402

# Device tokens as the providers issue them: APNs 32 bytes as 64 hex digits; an FCM
# registration token is about 160 characters (`<22 chars>:APA91b<134 chars>`).
APNS_TOKEN_CHARS = 64
FCM_TOKEN_CHARS = 163
TOKEN_HASH_CHARS = 64  # hex HMAC-SHA256, as receipts and tables carry it


def apns_token() -> str:
    return secrets.token_hex(APNS_TOKEN_CHARS // 2)


def fcm_token() -> str:
    body = secrets.token_urlsafe(FCM_TOKEN_CHARS)
    return f"{body[:22]}:APA91b{body[22 : FCM_TOKEN_CHARS - 7]}"


def fake_hash() -> str:
    return secrets.token_hex(TOKEN_HASH_CHARS // 2)


# --- receipts ------------------------------------------------------------------------


def sample_receipts(n: int, *, hashed: bool) -> list[Receipt]:
    """`n` receipts of the synthetic mix (90 % ok, retries, failures; docs/spark.md), as
    one node writes them (in time order, 200,000 device tokens); `hashed`: only those
    carrying a token hash (Matrix, Zulip, ...); else only Marmot's, which carry none."""
    out: list[Receipt] = []
    for receipt in synthetic.receipts(n * 8, seed=11, tokens=200_000, in_time_order=True, hours=24):
        if (receipt.token_hash is not None) == hashed:
            out.append(receipt)
            if len(out) == n:
                return out
    raise AssertionError("the synthetic mix ran short")  # pragma: no cover


async def write_receipts(
    items: list[Receipt], directory: Path, file_format: ReceiptsFormat
) -> None:
    writer = ReceiptWriter(directory, file_format=file_format)  # default roll_bytes, buffer
    await writer.start()
    for receipt in items:
        await writer.put(receipt)
    await writer.close()


async def receipt_bytes(n: int, *, hashed: bool = True) -> dict[str, float]:
    """Bytes per receipt on disk, each format as the writer publishes it, and gzipped."""
    items = sample_receipts(n, hashed=hashed)
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="pushgw-sizing-") as tmp:
        for file_format in ("jsonl", "parquet"):
            directory = Path(tmp) / file_format
            await write_receipts(items, directory, file_format)
            files = [p for p in directory.iterdir() if p.suffix == f".{file_format}"]
            assert files and len(files) == len(list(directory.iterdir())), files
            size = sum(p.stat().st_size for p in files)
            gz = sum(len(gzip.compress(p.read_bytes(), 6)) for p in files)
            figures[file_format] = size / n
            figures[f"{file_format}.gz"] = gz / n
    return figures


def buffered_receipt_bytes(n: int = 10_000) -> float:
    """Python heap bytes one receipt takes while it waits in the writer's buffer (the
    record dict the writer holds, as `ReceiptWriter.put` makes it)."""
    items = sample_receipts(n, hashed=True)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        held = [receipt_record(r) for r in items]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert len(held) == n
    return grown / n


# --- database ------------------------------------------------------------------------


async def _table_bytes(store: Store, tables: list[str]) -> dict[str, int]:
    """Bytes each table takes with its indexes (and, on PostgreSQL, TOAST)."""
    async with store.engine.connect() as conn:
        if store.dialect == "postgresql":
            rows = (
                await conn.execute(
                    text(
                        "SELECT relname, pg_total_relation_size(oid) FROM pg_class"
                        " WHERE relname = ANY(:t)"
                    ),
                    {"t": tables},
                )
            ).all()
            return {name: int(size) for name, size in rows}
        # SQLite: the table's pages and those of every index on it (dbstat)
        sizes: dict[str, int] = {}
        for table in tables:
            names = [table] + [
                row[0]
                for row in (
                    await conn.execute(
                        text(
                            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = :t"
                        ),
                        {"t": table},
                    )
                ).all()
            ]
            total = 0
            for name in names:
                total += (
                    await conn.execute(
                        text("SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name = :n"),
                        {"n": name},
                    )
                ).scalar_one()
            sizes[table] = int(total)
        return sizes


async def database_bytes(url: str, n: int) -> dict[str, float]:
    """Bytes per row (table + indexes) of each kind of record, on the database at `url`
    (fresh, migrated here to head with the Zulip branch)."""
    store = Store(url)
    figures: dict[str, float] = {}
    tables = [
        "zulip_servers",
        "zulip_realms",
        "zulip_e2ee_devices",
        "zulip_legacy_devices",
        "pushgw_invalid_tokens",
    ]
    try:
        await store.upgrade([zulip_migrations()])
        sizes = await _table_bytes(store, tables)

        def grew(table: str, key: str, now: dict[str, int]) -> None:
            figures[key] = (now[table] - sizes[table]) / n
            sizes[table] = now[table]

        # Zulip servers, one realm each (the bouncer's per-server rows)
        async with store.engine.begin() as conn:
            server_ids = []
            for i in range(n):
                server_uuid = str(uuid.uuid4())
                assert await repo.create_server(
                    conn,
                    server_uuid,
                    secrets.token_hex(32),
                    f"chat{i}.example.org",
                    "admin@example.org",
                )
                server = await repo.get_server(conn, server_uuid)
                assert server is not None
                server_ids.append(server.id)
                info = repo.RealmInfo(
                    uuid=str(uuid.uuid4()),
                    host=f"chat{i}.example.org",
                    name=f"Example organisation {i}",
                    org_type=10,
                    deactivated=False,
                    is_system_bot_realm=False,
                )
                await repo.upsert_realms(conn, server.id, [info], complete=True)
        now = await _table_bytes(store, tables)
        figures["zulip_server+realm"] = (
            now["zulip_servers"]
            - sizes["zulip_servers"]
            + now["zulip_realms"]
            - sizes["zulip_realms"]
        ) / n
        sizes.update(now)
        async with store.engine.connect() as conn:
            realm_ids = [
                r[0] for r in (await conn.execute(text("SELECT id FROM zulip_realms"))).all()
            ]

        for kind, make in (("apns", apns_token), ("fcm", fcm_token)):
            async with store.engine.begin() as conn:
                for i in range(n):
                    assert await repo.register_e2ee(
                        conn,
                        realm_id=realm_ids[i % len(realm_ids)],
                        token_id=secrets.randbits(63),
                        token=make(),
                        token_kind=kind,
                        ios_app_id="org.zulip.Zulip" if kind == "apns" else None,
                        token_hash=fake_hash(),
                    )
            grew("zulip_e2ee_devices", f"zulip_e2ee.{kind}", await _table_bytes(store, tables))

        for kind, make in (("apns", apns_token), ("fcm", fcm_token)):
            async with store.engine.begin() as conn:
                for i in range(n):
                    assert await repo.legacy_register(
                        conn,
                        server_id=server_ids[i % len(server_ids)],
                        user_id=None,
                        user_uuid=str(uuid.uuid4()),
                        realm_id=realm_ids[i % len(realm_ids)],
                        kind=1 if kind == "apns" else 2,
                        token=make(),
                        token_hash=fake_hash(),
                        ios_app_id="org.zulip.Zulip" if kind == "apns" else None,
                        apns=kind == "apns",
                    )
            grew("zulip_legacy_devices", f"zulip_legacy.{kind}", await _table_bytes(store, tables))

        async def told(_invalid: InvalidToken) -> None:
            return None

        invalidation = TokenInvalidation(store, Metrics(), told)
        for i in range(n):
            apns = i % 2 == 0
            outcome = await invalidation.handle(
                InvalidToken(
                    plugin="matrix",
                    app_id="im.vector.app.ios" if apns else "im.vector.app.android",
                    token_hash=fake_hash(),
                    token=None,
                    provider=ProviderKind.APNS if apns else ProviderKind.FCM,
                    reason="Unregistered" if apns else "UNREGISTERED",
                )
            )
            assert outcome.handled and outcome.record_error is None, outcome
        grew("pushgw_invalid_tokens", "invalid_token", await _table_bytes(store, tables))
    finally:
        await store.close()
    return figures


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--receipts", type=int, default=230_000, help="receipts per format")
    parser.add_argument("--rows", type=int, default=10_000, help="rows per kind of record")
    parser.add_argument("--postgres", help="an async PostgreSQL URL of a scratch database")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    out["receipts, with token hash"] = await receipt_bytes(args.receipts, hashed=True)
    out["receipts, no token hash"] = await receipt_bytes(args.receipts, hashed=False)
    out["receipt in the writer's buffer"] = buffered_receipt_bytes()
    with tempfile.TemporaryDirectory(prefix="pushgw-sizing-") as tmp:
        out["sqlite"] = await database_bytes(f"sqlite+aiosqlite:///{tmp}/sizing.db", args.rows)
    if args.postgres:
        out["postgresql"] = await database_bytes(args.postgres, args.rows)
    for name, value in out.items():
        if isinstance(value, dict):
            print(name)
            for key, figure in value.items():
                print(f"  {key:24} {figure:8.1f} bytes")
        else:
            print(f"{name}: {value:.1f} bytes")


if __name__ == "__main__":
    asyncio.run(main())
