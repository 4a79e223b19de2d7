"""`pushgw receipts cat`: receipts back as the writer's JSON Lines, from either format."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from gateway.cli import main as pushgw
from gateway.core.push import Receipt
from gateway.core.receipts import ReceiptsFormat, receipt_record, record_line
from gateway.receipt_files import published_files, read_records
from tests.core.conftest import make_receipts, write_groups

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def varied_receipts() -> list[Receipt]:
    return make_receipts(2_000, set(), seed=11)


def write(items: list[Receipt], directory: Path, file_format: ReceiptsFormat) -> Path:
    """The gateway's writer, one file per 500 receipts (every batch rolls its file)."""
    groups = [items[i : i + 500] for i in range(0, len(items), 500)]
    asyncio.run(write_groups(directory, groups, file_format=file_format, roll_bytes=1))
    return directory


def cat(capfdbinary: pytest.CaptureFixture[bytes], *args: str) -> tuple[int, bytes, str]:
    status = pushgw(["receipts", "cat", *args])
    out, err = capfdbinary.readouterr()
    return status, out, err.decode()


def test_parquet_receipts_print_as_the_writer_wrote_them(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    items = varied_receipts()
    jsonl = write(items, tmp_path / "jsonl", "jsonl")
    parquet = write(items, tmp_path / "parquet", "parquet")
    assert len(published_files(parquet)) > 3  # several files, read in order
    assert {f.suffix for f in published_files(parquet)} == {".parquet"}

    status, from_parquet, err = cat(capfdbinary, str(parquet))
    assert (status, err) == (0, "")
    expected = "".join(record_line(receipt_record(r)) for r in items).encode()
    assert from_parquet == expected
    assert cat(capfdbinary, str(jsonl)) == (0, expected, "")
    assert read_records(parquet) == [receipt_record(r) for r in items]


def test_a_directory_gives_its_published_files_recursively_in_name_order(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    line = {
        name: record_line({"v": 1, "push_id": name}).encode()
        for name in ("a", "b", "c", "open", "tmp", "hidden", "under")
    }
    host_b = tmp_path / "host-b"
    host_b.mkdir()
    (tmp_path / "receipts-20250101T020000Z-1-0001.jsonl").write_bytes(line["c"])
    (host_b / "receipts-20250101T010000Z-9-0001.jsonl").write_bytes(line["b"])
    (tmp_path / "receipts-20250101T000000Z-1-0001.jsonl").write_bytes(line["a"])
    # still being written, or not receipts: left out, as the Spark jobs leave them out
    (tmp_path / "receipts-20250101T030000Z-1-0002.jsonl.open").write_bytes(line["open"])
    (tmp_path / "receipts-20250101T030000Z-1-0002.parquet.tmp").write_bytes(line["tmp"])
    (tmp_path / ".receipts-hidden.jsonl").write_bytes(line["hidden"])
    (tmp_path / "_temporary").mkdir()
    (tmp_path / "_temporary" / "receipts-x.jsonl").write_bytes(line["under"])

    assert cat(capfdbinary, str(tmp_path)) == (0, line["a"] + line["b"] + line["c"], "")
    # a file named on the command line is printed whatever its name
    open_file = tmp_path / "receipts-20250101T030000Z-1-0002.jsonl.open"
    assert cat(capfdbinary, str(open_file)) == (0, line["open"], "")


def test_a_line_cut_short_is_printed_as_it_is_then_ended(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    path = tmp_path / "receipts-20250101T000000Z-1-0001.jsonl"
    path.write_bytes(b'{"v":1}\n{"v":1,"ts":17')
    assert cat(capfdbinary, str(path)) == (0, b'{"v":1}\n{"v":1,"ts":17\n', "")


def test_the_default_is_the_configured_directory(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    items = varied_receipts()[:50]
    receipts = write(items, tmp_path / "receipts", "parquet")
    config = tmp_path / "pushgw.yaml"
    config.write_text(yaml.safe_dump({"receipts": {"directory": str(receipts)}}))
    status = pushgw(["receipts", "cat", "--config", str(config)])
    out, err = capfdbinary.readouterr()
    assert (status, err) == (0, b"")
    assert out == "".join(record_line(receipt_record(r)) for r in items).encode()


def test_another_writers_parquet_file_prints_in_the_documented_shape(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """Columns in another order, an unknown one, narrower integers and a null where the
    writer never puts one (Spark's jobs skip such a row): printed as the record is."""
    path = tmp_path / "other.parquet"
    table = pa.table(
        {
            "extra": ["ignored"],
            "token_hash": [None],
            "latency_ms": [12.5],
            "attempts": pa.array([2], pa.int32()),
            "reason": ["BadDeviceToken"],
            "http_status": pa.array([400], pa.int32()),
            "status": ["permanent"],
            "provider": ["apns"],
            "app_id": ["ios"],
            "plugin": ["zulip"],
            "push_id": pa.array([None], pa.string()),
            "ts": [1735689600.5],
            "v": pa.array([1], pa.int32()),
        }
    )
    pq.write_table(table, path)
    expected = (
        '{"v":1,"ts":1735689600.5,"push_id":null,"plugin":"zulip","app_id":"ios",'
        '"provider":"apns","status":"permanent","http_status":400,"reason":"BadDeviceToken",'
        '"attempts":2,"latency_ms":12.5,"token_hash":null}\n'
    )
    assert cat(capfdbinary, str(path)) == (0, expected.encode(), "")
    # JSON has no NaN or infinity: such a number prints as null, the other rows as they are
    odd = tmp_path / "odd.parquet"
    ts = pa.array([float("nan"), 1735689600.5, 1735689601.0])
    latency = pa.array([1.0, float("inf"), 2.0])
    rows = pa.concat_tables([table] * 3)
    pq.write_table(rows.set_column(11, "ts", ts).set_column(2, "latency_ms", latency), odd)
    printed = [json.loads(line) for line in cat(capfdbinary, str(odd))[1].splitlines()]
    assert [(r["ts"], r["latency_ms"]) for r in printed] == [
        (None, 1.0),
        (1735689600.5, None),
        (1735689601.0, 2.0),
    ]
    # a column of a type the schema's cannot be read as: named, nothing of it printed
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(table.set_column(11, "ts", pa.array(["noon"])), wrong)
    assert cat(capfdbinary, str(wrong)) == (
        1,
        b"",
        f"pushgw: {wrong}: not a readable receipts Parquet file (ArrowInvalid)\n",
    )


def test_a_missing_path_prints_nothing(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    write(varied_receipts()[:10], tmp_path / "receipts", "jsonl")
    missing = tmp_path / "nope"
    status, out, err = cat(capfdbinary, str(tmp_path / "receipts"), str(missing))
    assert (status, out) == (2, b"")
    assert err == f"pushgw: error: {missing}: no such file or directory\n"


def test_an_unreadable_file_is_named_and_the_others_still_print(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    good = tmp_path / "receipts-20250101T000000Z-1-0001.jsonl"
    good.write_bytes(b'{"v":1}\n')
    corrupt = tmp_path / "receipts-20250101T010000Z-1-0002.parquet"
    corrupt.write_bytes(b"PAR1 a Parquet file cut short by a full disk")
    foreign = tmp_path / "receipts-20250101T020000Z-1-0003.parquet"
    pq.write_table(pa.table({"v": [1], "ts": [1.5]}), foreign)
    late = tmp_path / "receipts-20250101T030000Z-1-0004.jsonl"
    late.write_bytes(b'{"v":2}\n')

    status, out, err = cat(capfdbinary, str(tmp_path))
    assert (status, out) == (1, b'{"v":1}\n{"v":2}\n')
    assert err.splitlines() == [
        f"pushgw: {corrupt}: not a readable receipts Parquet file (ArrowInvalid)",
        f"pushgw: {foreign}: not a receipts file: no column 'push_id'",
    ]


def test_a_directory_that_cannot_be_listed_is_named(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "receipts-20250101T000000Z-1-0001.jsonl").write_bytes(b'{"v":1}\n')
    locked = tmp_path / "locked"
    locked.mkdir()
    listing = Path.iterdir

    def iterdir(self: Path) -> Iterator[Path]:
        # what a directory without read permission gives, even to root
        if self == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    status, out, err = cat(capfdbinary, str(tmp_path))
    assert (status, out, err) == (1, b'{"v":1}\n', f"pushgw: {locked}: Permission denied\n")


def test_a_closed_stdout_ends_quietly_with_141(tmp_path: Path) -> None:
    """`pushgw receipts cat DIR | head -1`: no traceback, and no file blamed for it."""
    receipts = write(varied_receipts(), tmp_path / "receipts", "parquet")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte: no race
    try:
        result = subprocess.run(
            [*PUSHGW, "receipts", "cat", str(receipts)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


def test_a_directory_reached_again_through_a_link_is_read_once(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    receipts = tmp_path / "receipts"
    receipts.mkdir()
    (receipts / "receipts-20250101T000000Z-1-0001.jsonl").write_bytes(b'{"v":1}\n')
    (receipts / "loop").symlink_to("..")  # back to receipts/ (its parent: also once)
    (receipts / "again").symlink_to(".")
    assert cat(capfdbinary, str(receipts)) == (0, b'{"v":1}\n', "")


def test_a_path_that_cannot_be_looked_at_is_a_usage_error(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    long_name = tmp_path / ("a" * 300)
    assert cat(capfdbinary, str(long_name)) == (
        2,
        b"",
        f"pushgw: error: {long_name}: File name too long\n",
    )


@pytest.mark.parametrize(
    ("redirect", "why"),
    [(">/dev/full", "No space left on device"), (">&-", "stdout is closed")],
)
def test_stdout_that_cannot_be_written_is_one_line(tmp_path: Path, redirect: str, why: str) -> None:
    receipts = write(varied_receipts(), tmp_path / "receipts", "parquet")
    command = " ".join([*PUSHGW, "receipts", "cat", str(receipts)])
    result = subprocess.run(
        ["sh", "-c", f"exec {command} {redirect}"],
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (
        1,
        f"pushgw: error: cannot write to stdout: {why}\n",
    )


def test_a_parquet_file_with_a_column_twice_is_named_not_a_traceback(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """Another tool's file may repeat a column name (Parquet allows it): Arrow refuses
    to pick the column by name with a KeyError, which must not escape as a traceback."""
    good = tmp_path / "receipts-20250101T000000Z-1-0001.jsonl"
    good.write_bytes(b'{"v":1}\n')
    twice = tmp_path / "receipts-20250101T010000Z-1-0002.parquet"
    row = receipt_record(varied_receipts()[0])
    names = [*row, "ts"]
    arrays = [pa.array([value]) for value in row.values()] + [pa.array([1.5])]
    pq.write_table(pa.Table.from_arrays(arrays, names=names), twice)
    assert cat(capfdbinary, str(tmp_path)) == (
        1,
        b'{"v":1}\n',
        f"pushgw: {twice}: not a receipts file: column 'ts' appears 2 times\n",
    )


def test_a_parquet_file_with_a_corrupt_page_is_named_as_not_readable(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A damaged page makes Arrow raise a plain OSError (no errno): that is the file's
    fault, not the file system's, and says so, as any other unreadable Parquet file."""
    path = tmp_path / "receipts-20250101T000000Z-1-0001.parquet"
    row = receipt_record(varied_receipts()[0])
    pq.write_table(pa.table({name: [value] for name, value in row.items()}), path)
    data = bytearray(path.read_bytes())
    for i in range(4, 60):  # the first page header, right after the magic bytes
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cat(capfdbinary, str(path)) == (
        1,
        b"",
        f"pushgw: {path}: not a readable receipts Parquet file (OSError)\n",
    )


def test_entries_of_a_directory_that_cannot_be_searched_are_named(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory readable but not searchable (`chmod a-x`): its names are listed, but
    looking at an entry fails with EACCES, which `Path.is_dir()` raises (it hides only
    ENOENT and the like): named on stderr, the other files still printed, no traceback."""
    (tmp_path / "receipts-20250101T000000Z-1-0001.jsonl").write_bytes(b'{"v":1}\n')
    locked = tmp_path / "locked"
    locked.mkdir()
    entry = locked / "receipts-20250101T010000Z-1-0002.jsonl"
    entry.write_bytes(b'{"v":2}\n')
    stat = Path.stat

    def no_search(self: Path, *, follow_symlinks: bool = True) -> os.stat_result:
        # what a directory without search permission gives, even to root
        if self.parent == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return stat(self, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(Path, "stat", no_search)
    status, out, err = cat(capfdbinary, str(tmp_path))
    assert (status, out, err) == (1, b'{"v":1}\n', f"pushgw: {entry}: Permission denied\n")
