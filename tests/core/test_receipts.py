"""The receipts writer: JSON Lines or Parquet rollover, recovery of crashed writers' files,
and writing through disk failures."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import gateway.core
from gateway.app import load_gateway, running_core
from gateway.core import receipts as receipts_module
from gateway.core import receipts_parquet
from gateway.core.receipts import ReceiptsFormat, ReceiptWriter, RollingFile, receipt_record
from gateway.receipt_files import read_records
from gateway.testing.harness import base_config
from tests.core.conftest import make_receipts, write_groups

CUT_LINE = '{"v":1,"ts":1735689600.5,"push_id":"6f1c'  # a write cut short by a crash


@pytest.fixture(autouse=True)
def immediate_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer still batches whatever is queued when it wakes; it just does not wait.
    monkeypatch.setattr(receipts_module, "_FLUSH_INTERVAL", 0)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def parquet_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    return [row for path in paths for row in pq.read_table(path).to_pylist()]


def jsonl(records: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)


# --- Parquet rollover ----------------------------------------------------------------


async def test_parquet_files_hold_exactly_the_records_put(
    tmp_path: Path, secrets_seen: set[str]
) -> None:
    items = make_receipts(500, secrets_seen)
    await write_groups(tmp_path, [items], file_format="parquet")
    (only,) = names(tmp_path)
    assert only.startswith("receipts-") and only.endswith(f"-{os.getpid()}-0001.parquet")
    path = tmp_path / only
    assert parquet_rows([path]) == [receipt_record(r) for r in items]
    assert pq.read_schema(path).equals(receipts_parquet.SCHEMA)
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "SNAPPY"


async def test_rolling_by_size_makes_one_parquet_file_per_roll(
    tmp_path: Path, secrets_seen: set[str]
) -> None:
    items = make_receipts(90, secrets_seen)
    groups = [items[:30], items[30:60], items[60:]]
    # roll_bytes=1: every batch after the first finds its file due and rolls it
    await write_groups(tmp_path, groups, file_format="parquet", roll_bytes=1)
    files = sorted(tmp_path.iterdir())
    assert [p.name[-12:] for p in files] == [f"{n:04d}.parquet" for n in (1, 2, 3)]
    for path, group in zip(files, groups, strict=True):
        assert parquet_rows([path]) == [receipt_record(r) for r in group]


async def test_jsonl_stays_the_default(tmp_path: Path, secrets_seen: set[str]) -> None:
    items = make_receipts(20, secrets_seen)
    writer = ReceiptWriter(tmp_path)
    await writer.start()
    for receipt in items:
        await writer.put(receipt)
    await writer.close()
    (only,) = tmp_path.iterdir()
    assert only.name.endswith(".jsonl")
    assert only.read_text() == jsonl(receipt_record(r) for r in items)


async def test_failed_conversion_keeps_the_jsonl_file(
    tmp_path: Path,
    secrets_seen: set[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(source: Path, target: Path) -> int:
        target.write_bytes(b"PAR1 half a file")
        first = source.read_text().splitlines()[0]
        raise ValueError(f"cannot convert {first}")  # as a parser quoting the record

    monkeypatch.setattr(receipts_parquet, "convert", broken)
    items = make_receipts(40, secrets_seen)
    await write_groups(tmp_path, [items], file_format="parquet")
    (only,) = tmp_path.iterdir()
    assert only.name.endswith(".jsonl")  # no .parquet, no .parquet.tmp, no .open
    assert only.read_text() == jsonl(receipt_record(r) for r in items)
    assert "stays JSON Lines, Parquet conversion failed: ValueError" in caplog.text
    # the autouse no_secrets_in_logs fixture checks that no push id or hash was logged


async def test_without_pyarrow_files_stay_jsonl(
    tmp_path: Path,
    secrets_seen: set[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # as if pyarrow were not installed: importing the converter fails
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.delitem(sys.modules, "gateway.core.receipts_parquet")
    monkeypatch.delattr(gateway.core, "receipts_parquet")
    items = make_receipts(10, secrets_seen)
    await write_groups(tmp_path, [items], file_format="parquet")
    (only,) = tmp_path.iterdir()
    assert only.name.endswith(".jsonl")
    assert only.read_text() == jsonl(receipt_record(r) for r in items)
    assert "files will stay JSON Lines: import of pyarrow halted" in caplog.text
    assert "stays JSON Lines, Parquet conversion failed: import of pyarrow halted" in caplog.text


async def test_the_gateway_passes_the_configured_format(
    tmp_path: Path, secrets_seen: set[str]
) -> None:
    gateway = load_gateway(data=base_config(tmp_path, {}, receipts={"format": "parquet"}))
    items = make_receipts(5, secrets_seen)
    core = running_core(gateway)
    async with core:
        assert core.writer is not None
        for receipt in items:
            await core.writer.put(receipt)
    (only,) = (tmp_path / "receipts").iterdir()
    assert parquet_rows([only]) == [receipt_record(r) for r in items]


@pytest.mark.parametrize("conversion", ["works", "fails"])
async def test_the_gateway_counts_published_files_by_format(
    tmp_path: Path, secrets_seen: set[str], monkeypatch: pytest.MonkeyPatch, conversion: str
) -> None:
    """A crashed writer's file recovered at start and the file closed at shutdown are
    both counted; with Parquet, a conversion that failed shows as a jsonl file."""
    if conversion == "fails":

        def broken(source: Path, target: Path) -> int:
            raise ValueError("cannot convert")

        monkeypatch.setattr(receipts_parquet, "convert", broken)
    text = jsonl(receipt_record(r) for r in make_receipts(3, secrets_seen))
    leftover(tmp_path / "receipts", dead_pid(), text)
    gateway = load_gateway(data=base_config(tmp_path, {}))  # the default: parquet
    core = running_core(gateway)
    async with core:
        assert core.writer is not None
        for receipt in make_receipts(5, secrets_seen, seed=8):
            await core.writer.put(receipt)
    registry = gateway.runtime.metrics.registry
    counts = {
        fmt: registry.get_sample_value("pushgw_receipt_files_published_total", {"format": fmt})
        for fmt in ("jsonl", "parquet")
    }
    expected = (
        {"jsonl": 0.0, "parquet": 2.0}
        if conversion == "works"
        else {
            "jsonl": 2.0,
            "parquet": 0.0,
        }
    )
    assert counts == expected
    suffixes = sorted(path.suffix for path in (tmp_path / "receipts").iterdir())
    assert suffixes == [".jsonl" if conversion == "fails" else ".parquet"] * 2


# --- recovery of files left by crashed writers ----------------------------------------


def dead_pid() -> int:
    """A pid no process has (pids stay below pid_max, at most 2**22)."""
    for pid in range(2**22, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("every pid is taken")


def leftover(directory: Path, pid: int, text: str, seq: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"receipts-20250101T000000Z-{pid}-{seq:04d}.jsonl.open"
    path.write_text(text)
    return path


async def start_and_close(directory: Path, file_format: ReceiptsFormat) -> None:
    writer = ReceiptWriter(directory, file_format=file_format)
    await writer.start()  # recovery is done when start() returns
    await writer.close()


async def test_dead_writers_file_is_published_as_jsonl(
    tmp_path: Path, secrets_seen: set[str]
) -> None:
    text = jsonl(receipt_record(r) for r in make_receipts(30, secrets_seen)) + CUT_LINE
    path = leftover(tmp_path, dead_pid(), text)
    await start_and_close(tmp_path, "jsonl")
    assert names(tmp_path) == [path.name.removesuffix(".open")]
    # the cut line stays: the Spark reader skips it and reports it by file and line
    assert (tmp_path / path.name.removesuffix(".open")).read_text() == text


async def test_dead_writers_file_is_converted_without_its_cut_line(
    tmp_path: Path, secrets_seen: set[str], caplog: pytest.LogCaptureFixture
) -> None:
    records = [receipt_record(r) for r in make_receipts(30, secrets_seen)]
    path = leftover(tmp_path, dead_pid(), jsonl(records) + CUT_LINE)
    await start_and_close(tmp_path, "parquet")
    target = tmp_path / path.name.replace(".jsonl.open", ".parquet")
    assert names(tmp_path) == [target.name]
    assert parquet_rows([target]) == records
    assert f"1 unparsable line(s) of {path.name}" in caplog.text
    assert "6f1c" not in caplog.text


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
async def test_dead_writers_empty_file_is_removed(
    tmp_path: Path, file_format: ReceiptsFormat
) -> None:
    leftover(tmp_path, dead_pid(), "")
    await start_and_close(tmp_path, file_format)
    assert names(tmp_path) == []


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
async def test_files_of_running_writers_are_left_alone(
    tmp_path: Path, secrets_seen: set[str], file_format: ReceiptsFormat
) -> None:
    text = jsonl(receipt_record(r) for r in make_receipts(3, secrets_seen))
    other = leftover(tmp_path, os.getppid(), text)  # another worker, still running
    ours = leftover(tmp_path, os.getpid(), text, seq=2)  # another writer of this process
    await start_and_close(tmp_path, file_format)
    assert names(tmp_path) == sorted([other.name, ours.name])
    assert other.read_text() == ours.read_text() == text


async def test_file_of_a_former_process_with_our_pid_is_recovered(
    tmp_path: Path, secrets_seen: set[str]
) -> None:
    records = [receipt_record(r) for r in make_receipts(3, secrets_seen)]
    path = leftover(tmp_path, os.getpid(), jsonl(records))
    written = receipts_module._PROCESS_STARTED - 60  # before this process started
    os.utime(path, (written, written))
    await start_and_close(tmp_path, "parquet")
    assert parquet_rows(tmp_path.glob("*.parquet")) == records
    assert not list(tmp_path.glob("*.open"))


async def test_a_file_another_worker_is_recovering_is_skipped(
    tmp_path: Path, secrets_seen: set[str]
) -> None:
    text = jsonl(receipt_record(r) for r in make_receipts(3, secrets_seen))
    path = leftover(tmp_path, dead_pid(), text)
    with path.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        await start_and_close(tmp_path, "parquet")
    assert names(tmp_path) == [path.name]


async def test_open_file_already_converted_before_a_crash_is_removed(
    tmp_path: Path, secrets_seen: set[str], caplog: pytest.LogCaptureFixture
) -> None:
    records = [receipt_record(r) for r in make_receipts(3, secrets_seen)]
    path = leftover(tmp_path, dead_pid(), jsonl(records))
    converted = tmp_path / path.name.replace(".jsonl.open", ".parquet")
    receipts_parquet.convert(path, converted)
    caplog.set_level(logging.INFO)
    # even with the format switched back to jsonl: no duplicate .jsonl next to the .parquet
    await start_and_close(tmp_path, "jsonl")
    assert names(tmp_path) == [converted.name]
    assert parquet_rows([converted]) == records
    assert f"recovered {path.name}" in caplog.text


@pytest.mark.parametrize("when", ["at a roll", "at recovery"])
async def test_the_parquet_file_is_on_disk_before_the_jsonl_file_goes(
    tmp_path: Path, secrets_seen: set[str], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A power loss must not lose a file's receipts: the `.jsonl.open` file (long on disk)
    may only be removed once the new `.parquet` file's data (fsync before its rename,
    else the name can survive with no data) and its name (the directory) are on disk."""
    events: list[tuple[str, str]] = []
    real_fsync, real_unlink = os.fsync, Path.unlink

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        events.append(("unlink", str(self)))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "unlink", unlink)
    items = make_receipts(20, secrets_seen)
    if when == "at a roll":
        await write_groups(tmp_path, [items], file_format="parquet")
    else:
        leftover(tmp_path, dead_pid(), jsonl(receipt_record(r) for r in items))
        await start_and_close(tmp_path, "parquet")
    (parquet,) = tmp_path.iterdir()
    assert parquet_rows([parquet]) == [receipt_record(r) for r in items]
    source = str(parquet.with_suffix(".jsonl.open"))
    assert events == [
        ("fsync", f"{parquet}.tmp"),  # the data, before the name is given to it
        ("fsync", str(tmp_path)),  # the rename
        ("unlink", source),
    ]


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
async def test_a_later_writer_with_our_pid_in_the_same_second_keeps_both_files(
    tmp_path: Path,
    secrets_seen: set[str],
    monkeypatch: pytest.MonkeyPatch,
    file_format: ReceiptsFormat,
) -> None:
    """A name is the start second, the pid and a counter that each writer starts at 1: a
    writer restarted in the same process (or a container's pid 1 restarted) within the
    second its predecessor opened a file gets the same name. Publishing it must neither
    replace the earlier file (jsonl) nor be taken for a leftover of it (parquet)."""
    second = time.gmtime(1_735_689_600)
    monkeypatch.setattr(time, "gmtime", lambda *_: second)
    first = make_receipts(10, secrets_seen)
    later = make_receipts(10, secrets_seen, seed=8)
    await write_groups(tmp_path, [first], file_format=file_format)
    await write_groups(tmp_path, [later], file_format=file_format)
    published = sorted(tmp_path.iterdir())
    assert [p.suffix for p in published] == [f".{file_format}"] * 2
    assert read_records(tmp_path) == [receipt_record(r) for r in first + later]


# --- failures of the disk, and rolling on time ------------------------------------------


class Disk:
    """Stands in for the writer's file operations: fails the next `failures` batches.

    A failing batch goes as a full disk does it: a first write takes `partial` bytes,
    the next one raises ENOSPC. Calls come from the writer thread; `failed` and
    `published` are set on the event loop.
    """

    def __init__(self, failures: int, partial: int = 10) -> None:
        self.loop = asyncio.get_running_loop()
        self.failures = failures
        self.partial = partial
        self.cut = False
        self.failed = asyncio.Event()
        self.published = asyncio.Event()
        self.truncate_fails = False
        self.publish_failures = 0

    def write_some(self, fd: int, data: memoryview) -> int:
        if not self.failures:
            return os.write(fd, data)
        if not self.cut and len(data) > self.partial:
            self.cut = True
            return os.write(fd, data[: self.partial])
        self.cut = False
        self.failures -= 1
        self.loop.call_soon_threadsafe(self.failed.set)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def truncate(self, fd: int, size: int) -> None:
        if self.truncate_fails:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        os.ftruncate(fd, size)

    def publish(self, path: Path, file_format: ReceiptsFormat) -> None:
        if self.publish_failures:
            self.publish_failures -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        receipts_module.finish(path, file_format)
        self.loop.call_soon_threadsafe(self.published.set)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(RollingFile, "_write_some", staticmethod(self.write_some))
        monkeypatch.setattr(RollingFile, "_truncate", staticmethod(self.truncate))
        monkeypatch.setattr(RollingFile, "_publish", staticmethod(self.publish))


class Counts:
    """The writer's metric callbacks, as events a test can wait for."""

    def __init__(self) -> None:
        self.written: asyncio.Queue[int] = asyncio.Queue()
        self.failures = 0
        self.failed = asyncio.Event()
        self.lost = 0

    def on_written(self, n: int) -> None:
        self.written.put_nowait(n)

    def on_write_failed(self) -> None:
        self.failures += 1
        self.failed.set()

    def on_lost(self, n: int) -> None:
        self.lost += n

    def writer(self, directory: Path, **options: Any) -> ReceiptWriter:
        return ReceiptWriter(
            directory,
            on_written=self.on_written,
            on_write_failed=self.on_write_failed,
            on_lost=self.on_lost,
            **options,
        )


def lines_of(directory: Path) -> list[str]:
    return [line for path in sorted(directory.iterdir()) for line in path.read_text().splitlines()]


async def test_a_failed_write_is_retried_and_nothing_is_lost_or_doubled(
    tmp_path: Path,
    secrets_seen: set[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(receipts_module, "_RETRY_BASE", 0.01)
    disk = Disk(failures=2)
    disk.install(monkeypatch)
    counts = Counts()
    writer = counts.writer(tmp_path)
    await writer.start()
    items = make_receipts(20, secrets_seen)
    for receipt in items[:10]:
        await writer.put(receipt)
    assert await counts.written.get() == 10  # after two failed attempts, all of them
    assert counts.failures == 2
    for receipt in items[10:]:
        await writer.put(receipt)
    await writer.close()
    (only,) = tmp_path.iterdir()
    assert only.name.endswith(".jsonl")
    # the parts of the failed attempts that reached the file were taken back
    assert only.read_text() == jsonl(receipt_record(r) for r in items)
    assert "writing failed (No space left on device); 10 record(s) kept in memory" in caplog.text
    assert "writing again after 2 failed attempt(s)" in caplog.text
    assert counts.lost == writer.lost == 0
    # the autouse no_secrets_in_logs fixture checks that no push id or hash was logged


async def test_a_failed_write_that_cannot_be_taken_back_is_not_written_twice(
    tmp_path: Path, secrets_seen: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receipts_module, "_RETRY_BASE", 0.01)
    items = make_receipts(5, secrets_seen)
    records = [receipt_record(r) for r in items]
    first_line = len(jsonl(records[:1]))
    disk = Disk(failures=1, partial=first_line + 7)  # one line and the start of the next
    disk.truncate_fails = True
    disk.install(monkeypatch)
    counts = Counts()
    writer = counts.writer(tmp_path)
    await writer.start()
    for receipt in items:
        await writer.put(receipt)
    assert await counts.written.get() == 1  # the line that made it into the first file
    assert await counts.written.get() == 4  # the others, into a new file
    await writer.close()
    first, second = sorted(tmp_path.iterdir())
    assert first.name.endswith("-0001.jsonl") and second.name.endswith("-0002.jsonl")
    # the first file ends with a cut line, as after a crash: the Spark jobs skip it
    assert first.read_text() == jsonl(records[:1]) + jsonl(records[1:2])[:7]
    assert second.read_text() == jsonl(records[1:])


async def test_close_gives_up_after_one_last_attempt_and_counts_the_loss(
    tmp_path: Path,
    secrets_seen: set[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(receipts_module, "_RETRY_BASE", 3600.0)  # only close() ends the wait
    disk = Disk(failures=10**9)
    disk.install(monkeypatch)
    counts = Counts()
    writer = counts.writer(tmp_path, buffer=2)
    await writer.start()
    items = make_receipts(3, secrets_seen)
    for receipt in items[:2]:
        await writer.put(receipt)
    await counts.failed.wait()
    blocked = asyncio.create_task(writer.put(items[2]))  # the buffer is full: back-pressure
    await asyncio.sleep(0)  # one loop step: the put() is now waiting for room
    assert not blocked.done()
    await asyncio.wait_for(writer.close(), 10)  # a bound for a failing test, not a sleep
    await blocked  # released by close(), not stuck
    assert counts.lost == writer.lost == 3
    assert counts.failures == 2  # the first attempt and the last one
    assert "2 accepted receipt record(s) could not be written and are lost" in caplog.text
    assert "1 accepted receipt record(s) arrived after the writer closed" in caplog.text
    assert names(tmp_path) == []  # the empty file was removed, nothing half-written stays


async def test_a_failed_rename_at_rollover_is_retried(
    tmp_path: Path, secrets_seen: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receipts_module, "_RETRY_BASE", 0.01)
    disk = Disk(failures=0)
    disk.publish_failures = 2
    disk.install(monkeypatch)
    counts = Counts()
    writer = counts.writer(tmp_path, roll_bytes=1)  # every batch rolls its file
    await writer.start()
    items = make_receipts(6, secrets_seen)
    for receipt in items[:3]:
        await writer.put(receipt)
    await disk.published.wait()  # third attempt, while the writer kept running
    assert counts.failures == 2
    (published,) = tmp_path.iterdir()
    assert published.name.endswith("-0001.jsonl")
    for receipt in items[3:]:
        await writer.put(receipt)
    await writer.close()
    assert [p.name[-10:] for p in sorted(tmp_path.iterdir())] == ["0001.jsonl", "0002.jsonl"]
    assert lines_of(tmp_path) == [
        json.dumps(receipt_record(r), separators=(",", ":")) for r in items
    ]


async def test_the_gateway_counts_failed_receipt_writes(
    tmp_path: Path, secrets_seen: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receipts_module, "_RETRY_BASE", 3600.0)  # the shutdown retries
    disk = Disk(failures=1)
    disk.install(monkeypatch)
    gateway = load_gateway(data=base_config(tmp_path, {}))
    items = make_receipts(3, secrets_seen)
    core = running_core(gateway)
    async with core:
        assert core.writer is not None
        for receipt in items:
            await core.writer.put(receipt)
        await disk.failed.wait()
    text = gateway.runtime.metrics.exposition().decode()
    assert "pushgw_receipt_write_failures_total 1.0" in text
    assert "pushgw_receipts_lost_total 0.0" in text
    assert "pushgw_receipts_written_total 3.0" in text
    (published,) = (tmp_path / "receipts").iterdir()
    assert read_records(published) == [receipt_record(r) for r in items]


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
async def test_an_idle_file_rolls_on_time(
    tmp_path: Path,
    secrets_seen: set[str],
    monkeypatch: pytest.MonkeyPatch,
    file_format: ReceiptsFormat,
) -> None:
    loop = asyncio.get_running_loop()
    rolled = asyncio.Event()
    real_finish = receipts_module.finish

    def finish(path: Path, fmt: ReceiptsFormat) -> None:
        real_finish(path, fmt)
        loop.call_soon_threadsafe(rolled.set)

    monkeypatch.setattr(receipts_module, "finish", finish)
    writer = ReceiptWriter(tmp_path, roll_seconds=0.2, file_format=file_format)
    await writer.start()
    items = make_receipts(3, secrets_seen)
    for receipt in items:
        await writer.put(receipt)
    # no record arrives after these: the file is published when its time is up
    await asyncio.wait_for(rolled.wait(), 10)  # a bound for a failing test, not a sleep
    (published,) = tmp_path.iterdir()
    assert published.suffix == f".{file_format}"
    await writer.close()
    assert names(tmp_path) == [published.name]


async def test_close_after_a_cancelled_close_finishes_the_job(
    tmp_path: Path, secrets_seen: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close() cancelled (here by its caller's timeout) while a write is under way
    leaves the closing to go on: the next close() waits for it instead of raising
    CancelledError, and the file is published holding each record once."""
    loop = asyncio.get_running_loop()
    writing = asyncio.Event()  # the writer thread is inside a write
    release = threading.Event()  # lets that write go on

    def write_some(fd: int, data: memoryview) -> int:
        loop.call_soon_threadsafe(writing.set)
        release.wait(10)  # a bound for a failing test: the test releases it
        return os.write(fd, data)

    monkeypatch.setattr(RollingFile, "_write_some", staticmethod(write_some))
    counts = Counts()
    writer = counts.writer(tmp_path)
    await writer.start()
    items = make_receipts(2, secrets_seen)
    for receipt in items:
        await writer.put(receipt)
    await writing.wait()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):  # cannot finish: the write is held
            await writer.close()
    release.set()
    try:
        await asyncio.wait_for(writer.close(), 10)  # a bound for a failing test
    except asyncio.CancelledError:
        pytest.fail("close() after a cancelled close() raised CancelledError")
    (published,) = tmp_path.iterdir()
    assert published.name.endswith(".jsonl")
    assert published.read_text() == jsonl(receipt_record(r) for r in items)
    assert counts.lost == writer.lost == 0
