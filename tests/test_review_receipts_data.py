"""Receipts as a data product: a data engineer reading the receipts directory with
pyarrow, pandas or DuckDB (not the Spark jobs) while the gateway writes it
(docs/receipts.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from gateway.core import receipts as receipts_module
from gateway.core.push import Receipt
from gateway.core.receipts import ReceiptWriter, finish, receipt_record, record_line
from spark_plugins import synthetic

DOC = Path(__file__).parents[1] / "docs" / "receipts.md"


@pytest.fixture(autouse=True)
def immediate_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer still batches whatever is queued when it wakes; it just does not wait.
    monkeypatch.setattr(receipts_module, "_FLUSH_INTERVAL", 0)


class LiveWriter:
    """A real ReceiptWriter, told (through `on_written`) when each batch is in its file."""

    def __init__(self, directory: Path, **kwargs: Any) -> None:
        loop = asyncio.get_running_loop()
        self.written: asyncio.Queue[int] = asyncio.Queue()
        self.writer = ReceiptWriter(
            directory,
            file_format="parquet",
            on_written=lambda n: loop.call_soon_threadsafe(self.written.put_nowait, n),
            **kwargs,
        )

    async def write(self, items: Sequence[Receipt]) -> None:
        for item in items:
            await self.writer.put(item)
        done = 0
        while done < len(items):
            done += await self.written.get()
        assert done == len(items)


def items(n: int, seed: int) -> list[Receipt]:
    return list(synthetic.receipts(n, seed=seed))


# --- one long receipt must not keep a whole file out of Parquet -----------------------


async def test_a_receipt_longer_than_an_arrow_block_is_converted_with_its_file(
    tmp_path: Path,
) -> None:
    """A provider's error text is the receipt's `reason`, whatever its length; escaped
    (`\\u00e9`), 400,000 accented characters make a 2.4 MB line. Arrow's JSON reader
    refuses a record that straddles more than two of its 1 MiB blocks, so the whole
    file, an hour of receipts, stayed JSON Lines in a Parquet directory."""
    batch = items(300, seed=21)
    batch[150] = dataclasses.replace(batch[150], reason="\u00e9" * 400_000)
    assert len(record_line(receipt_record(batch[150]))) > 2 << 20
    writer = LiveWriter(tmp_path)
    await writer.writer.start()
    await writer.write(batch)
    await writer.writer.close()
    (published,) = sorted(tmp_path.iterdir())
    assert published.suffix == ".parquet", published.name
    rows = pq.read_table(published).to_pylist()
    assert rows == [receipt_record(r) for r in batch]
    assert rows[150]["reason"] == "\u00e9" * 400_000


def test_a_crashed_file_with_a_long_line_and_a_cut_one_keeps_every_whole_record(
    tmp_path: Path,
) -> None:
    """The same through recovery's path: a long line, then a line a crash cut short."""
    batch = items(20, seed=22)
    batch[3] = dataclasses.replace(batch[3], reason="x" * (1 << 21))
    text = "".join(record_line(receipt_record(r)) for r in batch)
    cut = record_line(receipt_record(items(1, seed=23)[0]))[:50]
    path = tmp_path / "receipts-20250101T000000Z-1-0001.jsonl.open"
    path.write_text(text + cut)
    assert finish(path, "parquet") == "parquet"
    target = tmp_path / "receipts-20250101T000000Z-1-0001.parquet"
    assert sorted(tmp_path.iterdir()) == [target]
    assert pq.read_table(target).to_pylist() == [receipt_record(r) for r in batch]


# --- the schema is the documented one, in every file ----------------------------------


def documented_parquet_schema() -> list[tuple[str, str, bool]]:
    """(name, type, nullable) of each line of the schema block in docs/receipts.md."""
    text = DOC.read_text()
    block = re.search(r"```\n(v +int64 +required\n.*?)```", text, re.DOTALL)
    assert block is not None, "docs/receipts.md has no Parquet schema block"
    columns = []
    for line in block[1].splitlines():
        name, kind, repetition = line.split()
        assert repetition in ("required", "optional"), line
        columns.append((name, kind, repetition == "optional"))
    return columns


def file_schema(path: Path) -> list[tuple[str, str, bool]]:
    return [(f.name, str(f.type), f.nullable) for f in pq.read_schema(path)]


async def test_every_published_parquet_file_has_the_documented_schema(tmp_path: Path) -> None:
    """Files of a busy writer, of one whose nullable columns are all null (no app
    matched, Marmot's unlinkable hashes), a crashed writer's file recovered without its
    cut line, and one that held only a cut line (no rows): one schema, the documented
    one, so a dataset scan over all of them sees no int32/int64 or null-type drift."""
    documented = documented_parquet_schema()
    assert [name for name, _, _ in documented] == list(receipt_record(items(1, 1)[0]))
    busy = tmp_path / "busy"
    writer = LiveWriter(busy, roll_bytes=1)  # each batch after the first rolls
    await writer.writer.start()
    await writer.write(items(50, seed=31))
    nulls = [
        dataclasses.replace(r, provider=None, status=None, reason=None, token_hash=None)
        for r in items(10, seed=32)
    ]
    await writer.write(nulls)
    await writer.writer.close()
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    whole = "".join(record_line(receipt_record(r)) for r in items(5, seed=33))
    for seq, text in ((1, whole + whole[:40]), (2, whole[:40])):
        path = crashed / f"receipts-20250101T000000Z-7-{seq:04d}.jsonl.open"
        path.write_text(text)
        assert finish(path, "parquet") == "parquet"
    files = sorted(busy.glob("*.parquet")) + sorted(crashed.glob("*.parquet"))
    assert len(files) == 4
    assert [pq.read_metadata(f).num_rows for f in files] == [50, 10, 5, 0]
    assert pq.read_table(files[1]).column("token_hash").null_count == 10
    for path in files:
        assert file_schema(path) == documented, path.name
    # one scan over all of them: no type conflict, every row once
    assert ds.dataset([str(f) for f in files], format="parquet").count_rows() == 65


# --- reading while the gateway writes ---------------------------------------------------


async def test_the_documented_glob_reads_each_published_receipt_once_while_writing(
    tmp_path: Path,
) -> None:
    """The doc's pyarrow recipe over a directory whose writer has a file open (receipts
    already in it) and a conversion's `.parquet.tmp` without its footer: the published
    receipts, each once, nothing of the files still being written."""
    published, pending = items(40, seed=41), items(7, seed=42)
    first = LiveWriter(tmp_path)
    await first.writer.start()
    await first.write(published)
    await first.writer.close()  # publishes its file
    live = LiveWriter(tmp_path)
    await live.writer.start()
    try:
        await live.write(pending)  # in a `.jsonl.open`, not yet published
        (tmp_path / "receipts-20250101T000000Z-9-0001.parquet.tmp").write_bytes(b"PAR1\0\0")
        names = sorted(p.name for p in tmp_path.iterdir())
        assert sum(n.endswith(".jsonl.open") for n in names) == 1, names
        assert sum(n.endswith(".parquet") for n in names) == 1, names

        files = sorted(glob.glob(f"{glob.escape(str(tmp_path))}/**/*.parquet", recursive=True))
        table = ds.dataset(files, format="parquet").to_table()
        assert table.to_pylist() == [receipt_record(r) for r in published]
    finally:
        await live.writer.close()
    files = sorted(glob.glob(f"{glob.escape(str(tmp_path))}/**/*.parquet", recursive=True))
    rows = ds.dataset(files, format="parquet").to_table().to_pylist()
    assert sorted(r["push_id"] for r in rows) == sorted(r.push_id for r in published + pending)


def test_duckdb_reads_the_directory_as_documented(tmp_path: Path) -> None:
    """The doc's DuckDB query over published Parquet files, an in-progress `.jsonl.open`
    and `.parquet.tmp`, and a crashed writer's `.jsonl` whose last line was cut: the
    JSON Lines recipe keeps `v = 1`, and `ts` converts to a UTC timestamp."""
    import duckdb  # a dev dependency: docs/receipts.md gives this recipe

    parquet_items, jsonl_items = items(30, seed=51), items(12, seed=52)
    synthetic.write_with_receipt_writer(parquet_items, tmp_path, file_format="parquet")
    synthetic.write_with_receipt_writer(jsonl_items, tmp_path / "old")
    (crashed,) = (tmp_path / "old").glob("*.jsonl")
    crashed.write_text(crashed.read_text() + '{"v":1,"ts":17356')
    (tmp_path / "receipts-20990101T000000Z-9-0001.jsonl.open").write_text("{}\n")
    (tmp_path / "receipts-20990101T000000Z-9-0001.parquet.tmp").write_bytes(b"PAR1\0")

    con = duckdb.connect()
    by_status = dict(
        con.sql(
            f"SELECT status, count(*) FROM read_parquet('{tmp_path}/**/*.parquet', "
            "union_by_name = true) GROUP BY status"
        ).fetchall()
    )
    expected: dict[str, int] = {}
    for r in parquet_items:
        expected[r.outcome.value] = expected.get(r.outcome.value, 0) + 1
    assert by_status == expected
    columns = {
        f.name: _duckdb_type(f.type) for f in pq.read_schema(next(tmp_path.glob("*.parquet")))
    }
    ((count,),) = con.sql(
        f"SELECT count(*) FROM read_json('{tmp_path}/**/*.jsonl', "
        f"format = 'newline_delimited', columns = {json.dumps(columns)}, "
        "ignore_errors = true) WHERE v = 1"
    ).fetchall()
    assert count == len(jsonl_items)
    ((first,),) = con.sql(
        f"SELECT min(epoch(to_timestamp(ts))) FROM read_parquet('{tmp_path}/*.parquet')"
    ).fetchall()
    assert first == pytest.approx(min(r.finished_at for r in parquet_items), abs=1e-5)


def _duckdb_type(kind: pa.DataType) -> str:
    return {"int64": "BIGINT", "double": "DOUBLE", "string": "VARCHAR"}[str(kind)]
