"""Review from the seat of an operator with a year of receipts in one tree, read by the
Spark jobs and by `pushgw receipts cat`: files of every writer version and both formats,
nested date directories, the live writer's files, empty and foreign files, links and an
archived (gzip-compressed) JSON Lines file.

The receipt record has not changed since the first writer (`git log -p --
gateway/core/receipts*`: the same twelve fields, JSON Lines first, Parquet of the same
schema later), so the gateway's current writer stands in for every earlier version.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gateway.cli import main as pushgw
from gateway.core.push import Receipt
from gateway.core.receipts import receipt_record, record_line
from gateway.receipt_files import published_files, read_records
from spark_plugins import runner, synthetic
from spark_plugins.dead_tokens import JOB as DEAD_TOKENS
from spark_plugins.reader import read_receipts
from tests.spark.conftest import START
from tests.spark.test_review_operator import _no_spark


def _items(n: int, seed: int) -> list[Receipt]:
    return list(synthetic.receipts(n, seed=seed, start=START, hours=24, tokens=40))


def _cat(capfdbinary: pytest.CaptureFixture[bytes], *paths: Path) -> tuple[int, bytes, str]:
    status = pushgw(["receipts", "cat", *map(str, paths)])
    out, err = capfdbinary.readouterr()
    return status, out, err.decode()


def _lines(items: list[Receipt]) -> bytes:
    return "".join(record_line(receipt_record(r)) for r in items).encode()


def _year_tree(root: Path) -> tuple[list[Receipt], Path]:
    """A receipts tree as an operator has it; returns the receipts it publishes and the
    JSON Lines file whose last line a crash cut short."""
    day1, day2, top = _items(60, 1), _items(50, 2), _items(40, 3)
    synthetic.write_with_receipt_writer(day1, root / "2025" / "01" / "01")  # JSON Lines
    synthetic.write_with_receipt_writer(day2, root / "2025" / "01" / "02", file_format="parquet")
    synthetic.write_with_receipt_writer(top, root)
    (crashed,) = root.glob("*.jsonl")
    whole = crashed.read_bytes()
    cut = record_line(receipt_record(_items(1, 4)[0])).encode()[:-20]  # no newline
    crashed.write_bytes(whole + cut)
    # the live writer's files, never read
    (root / "receipts-20260101T000000Z-99-0001.jsonl.open").write_bytes(whole[: len(whole) // 2])
    (root / "receipts-20260101T000000Z-99-0001.parquet.tmp").write_bytes(b"PAR1\0\0")
    # empty and foreign files; hidden and `_` entries Spark never lists
    (root / "2025" / "01" / "03").mkdir(parents=True)
    (root / "2025" / "01" / "03" / "receipts-empty.jsonl").write_bytes(b"")
    pq.write_table(pa.table({"a": [1, 2, 3]}), root / "someone-elses.parquet")
    (root / "README.txt").write_text("receipts of gw-1\n")
    (root / "_SUCCESS").write_bytes(b"")
    (root / ".DS_Store").write_bytes(b"\0\1\2")
    (root / ".snapshot").mkdir()
    shutil.copy(crashed, root / ".snapshot" / crashed.name)
    (root / f".{crashed.name}.crc").write_bytes(b"crc\0")
    # a link to a directory outside the tree is read once, through the link
    outside = root.parent / "other-disk"
    more = _items(30, 5)
    synthetic.write_with_receipt_writer(more, outside)
    (root / "node-b").symlink_to(outside)
    return day1 + day2 + top + more, crashed


@pytest.mark.spark
def test_a_year_tree_is_read_whole_by_the_jobs_and_by_cat(
    spark: Any, tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """Pins the mixed tree: every published receipt once, the cut line reported by file
    and line, the foreign Parquet file by file, nothing else read or fatal."""
    root = tmp_path / "receipts"
    items, crashed = _year_tree(root)
    source = read_receipts(spark, str(root))
    push_ids = sorted(row["push_id"] for row in source.df.select("push_id").collect())
    stats = source.stats()
    assert push_ids == sorted(r.push_id for r in items)
    assert stats.records == len(items)
    assert stats.bad == 1 + 3  # the cut line, the three foreign rows
    shown = {(b.file, b.line) for b in stats.bad_lines}
    crashed_lines = crashed.read_bytes().count(b"\n") + 1
    assert (str(crashed), crashed_lines) in shown
    assert (str(root / "someone-elses.parquet"), None) in shown

    status, out, err = _cat(capfdbinary, root)
    assert status == 1  # the foreign Parquet file is named, the rest printed
    assert err.strip().splitlines() == [
        f"pushgw: {root / 'someone-elses.parquet'}: not a receipts file: no column 'v'"
    ]
    records, unparsable = [], []
    for line in out.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            unparsable.append(line)
    assert sorted(r["push_id"] for r in records) == sorted(r.push_id for r in items)
    assert len(unparsable) == 1 and crashed.read_bytes().endswith(unparsable[0])


def test_cat_prints_a_file_reached_by_two_names_once(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A `latest.jsonl` symbolic link and a hard-linked snapshot of a node's directory
    (`cp -al`) are second names of files already read: their receipts came out two and
    three times, where the Spark jobs refuse such a tree rather than count twice."""
    root = tmp_path / "receipts"
    items = _items(40, 6)
    synthetic.write_with_receipt_writer(items, root / "node-a")
    (published,) = (root / "node-a").glob("*.jsonl")
    (root / "latest.jsonl").symlink_to(published)
    (root / "snapshot").mkdir()
    os.link(published, root / "snapshot" / published.name)

    assert len(published_files(root)) == 1
    assert read_records(root) == [receipt_record(r) for r in items]
    assert _cat(capfdbinary, root) == (0, _lines(items), "")


def test_a_hard_link_in_the_tree_is_a_usage_error_before_spark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hard link is a second route to a receipts file like a symbolic link: Spark
    lists both names and counted every receipt of it twice, silently."""
    _no_spark(monkeypatch)
    root = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(_items(5, 7), root / "node-a")
    (published,) = (root / "node-a").glob("*.jsonl")
    (root / "backup").mkdir()
    os.link(published, root / "backup" / published.name)
    status, _ = runner.run_jobs([DEAD_TOKENS], str(root), str(tmp_path / "out"))
    assert status == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"pushgw spark: receipts directory {root}: ")
    assert "are the same file" in err and "would be read twice" in err
    assert not (tmp_path / "out").exists()


def test_cat_decompresses_an_archived_gzip_file(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """`gzip receipts-*.jsonl` to save room, then `pushgw receipts cat FILE.jsonl.gz`:
    the compressed bytes went to stdout as if they were JSON Lines, status 0."""
    items = _items(30, 8)
    synthetic.write_with_receipt_writer(items, tmp_path / "r")
    (published,) = (tmp_path / "r").glob("*.jsonl")
    archived = tmp_path / (published.name + ".gz")
    archived.write_bytes(gzip.compress(published.read_bytes()))
    assert _cat(capfdbinary, archived) == (0, _lines(items), "")
    assert read_records(archived) == [receipt_record(r) for r in items]


def test_cat_names_a_gzip_file_cut_short_and_goes_on(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A gzip file cut short (copied while `gzip` still wrote it) is named on stderr
    with status 1, never a traceback; what it held before the cut is printed, and the
    next file's first line starts on a line of its own."""
    items = _items(300, 9)
    synthetic.write_with_receipt_writer(items, tmp_path / "r")
    (published,) = (tmp_path / "r").glob("*.jsonl")
    packed = gzip.compress(published.read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed[: len(packed) * 2 // 3])
    status, out, err = _cat(capfdbinary, cut, published)
    assert status == 1
    assert err.strip().splitlines() == [
        f"pushgw: {cut}: gzip-compressed data cut short or damaged (EOFError)"
    ]
    assert out.endswith(_lines(items))  # the whole file after it, line for line
    before = out[: -len(_lines(items))]
    assert before.count(b"\n") > 10  # the receipts before the cut
    assert before.endswith(b"\n") and b"\x1f\x8b" not in before
    assert _lines(items).startswith(b"".join(before.splitlines(keepends=True)[:-1]))
