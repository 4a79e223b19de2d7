"""The disk fills up (and other exhausted resources): the receipts writer on a real full
disk, a file that may grow no further, and what /readyz and /metrics say meanwhile.

The full disk is a real one: a 256 KiB tmpfs mounted for the test under /tmp/diskfull
(skipped where mounting is not permitted). The file size limit is a real one too:
RLIMIT_FSIZE in a subprocess, whose writes then fail with EFBIG.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import gateway.app
from gateway.core import receipts as receipts_module
from gateway.core.push import Receipt
from gateway.core.receipts import ReceiptsFormat, ReceiptWriter, receipt_record, record_line
from gateway.receipt_files import read_records
from gateway.testing.harness import GatewayHarness, base_config
from tests.conftest import LOG_CAPTURE
from tests.core.conftest import make_receipts

DISK_SIZE = 256 * 1024
GUARD = 30.0  # a bound for a failing test, never reached by a passing one


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer's policy is unchanged; it just does not wait 0.25 s to 10 s between steps.
    monkeypatch.setattr(receipts_module, "_FLUSH_INTERVAL", 0)
    monkeypatch.setattr(receipts_module, "_RETRY_BASE", 0.01)
    monkeypatch.setattr(receipts_module, "_RETRY_CAP", 0.02)


def _mount(target: Path, size: int) -> subprocess.CompletedProcess[bytes]:
    options = f"size={size}" if not target.is_mount() else f"remount,size={size}"
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        check=False,
    )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB file system (tmpfs) in the test's own tmp_path, unmounted at the end."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mountpoint = tmp_path / "small-disk"
    mountpoint.mkdir()
    done = _mount(mountpoint, DISK_SIZE)
    if done.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        # Lazily when busy: a failing test's writer thread may still hold a file there.
        if subprocess.run(["umount", str(mountpoint)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], check=True)
        mountpoint.rmdir()


def fill(path: Path) -> None:
    """Take every byte left on `path`'s file system."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


class Events:
    """The writer's metric callbacks, as a queue a test waits on (no polling)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self.written = 0
        self.failures = 0

    def on_written(self, n: int) -> None:
        self.written += n
        self.queue.put_nowait(("written", n))

    def on_write_failed(self) -> None:
        self.failures += 1
        self.queue.put_nowait(("failed", 1))

    async def next(self) -> str:
        kind, _ = await asyncio.wait_for(self.queue.get(), GUARD)
        return kind

    async def failure(self) -> None:
        while await self.next() != "failed":
            pass

    async def written_reaches(self, count: int) -> None:
        while self.written < count:
            await self.next()

    def writer(self, directory: Path, **options: Any) -> ReceiptWriter:
        return ReceiptWriter(
            directory,
            on_written=self.on_written,
            on_write_failed=self.on_write_failed,
            **options,
        )


@contextlib.asynccontextmanager
async def running(writer: ReceiptWriter) -> AsyncIterator[ReceiptWriter]:
    """A started writer, closed at the end even when the test fails (so that its
    thread lets go of the small disk, which is then unmounted)."""
    await writer.start()
    try:
        yield writer
    finally:
        await asyncio.wait_for(writer.close(), GUARD)  # a second close() waits for the first


def every_line_whole(directory: Path) -> None:
    for path in directory.glob("*.jsonl"):
        data = path.read_bytes()
        assert data.endswith(b"\n"), path.name
        for line in data.splitlines():
            json.loads(line)


# --- the receipts volume fills up, then space returns ------------------------------------


async def test_a_backlog_larger_than_the_space_that_returns_is_written_as_space_allows(
    small_disk: Path,
) -> None:
    """The disk is full while 2,000 receipts (twice the disk) pile up in the buffer.
    When 256 KiB come back, the writer used to try the whole backlog at each attempt,
    cut it back, and write nothing at all for as long as the space freed was less than
    the backlog (the buffer then fills and every push waits). Now each attempt keeps the
    complete lines that fit; once the volume is grown, the rest follows, each receipt
    once, no line cut, no `.jsonl.open` left."""
    directory = small_disk / "receipts"
    events = Events()
    items = make_receipts(2000, set())
    async with running(events.writer(directory)) as writer:
        await fill_free_some_then_grow(small_disk, writer, events, items)
    assert writer.lost == 0 and not writer.failing
    assert not list(directory.glob("*.open"))
    every_line_whole(directory)
    assert read_records(directory) == [receipt_record(r) for r in items]


async def fill_free_some_then_grow(
    disk: Path, writer: ReceiptWriter, events: Events, items: list[Receipt]
) -> None:
    """`items` (more than twice the disk) wait while the disk is full; then the disk
    is freed (room for part of them), then grown (room for all)."""
    filler = disk / "filler"
    fill(filler)
    assert sum(len(record_line(receipt_record(r))) for r in items) > 2 * DISK_SIZE
    for receipt in items:
        await writer.put(receipt)
    await events.failure()
    assert writer.failing

    filler.unlink()  # about half the backlog's room comes back
    attempts = events.failures
    while events.written == 0 and events.failures < attempts + 3:
        await events.next()
    assert events.written > 0, "nothing written though the disk has room again"
    assert events.written < len(items)  # the disk is full again: the rest waits

    assert _mount(disk, 16 * DISK_SIZE).returncode == 0  # the volume is grown
    await events.written_reaches(len(items))


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
async def test_closing_on_a_full_disk_publishes_and_counts_the_rest(
    small_disk: Path, file_format: ReceiptsFormat
) -> None:
    """Shutdown on a full disk: the receipts written are published (with Parquet, kept
    as JSON Lines: there is no room for the conversion, and no `.parquet.tmp` stays);
    those still in memory are counted as lost in one line, without a traceback."""
    secrets: set[str] = set()
    directory = small_disk / "receipts"
    events = Events()
    lost: list[int] = []
    items = make_receipts(300, secrets)
    writer = events.writer(directory, file_format=file_format, on_lost=lost.append)
    async with running(writer):
        for receipt in items[:200]:
            await writer.put(receipt)
        await events.written_reaches(200)
        fill(small_disk / "filler")
        mark = len(LOG_CAPTURE.lines)
        for receipt in items[200:]:
            await writer.put(receipt)
        await events.failure()
    # What fitted in the file's last page is written, no more.
    written = events.written
    assert 200 <= written < len(items)
    assert lost == [len(items) - written] and writer.lost == len(items) - written
    (published,) = directory.iterdir()
    assert published.suffix == ".jsonl"  # the Parquet conversion had no room either
    assert read_records(directory) == [receipt_record(r) for r in items[:written]]
    every_line_whole(directory)
    logged = "\n".join(LOG_CAPTURE.lines[mark:])
    assert f"{len(items) - written} accepted receipt record(s) could not be written" in logged
    assert "Traceback" not in logged
    assert not any(secret in logged for secret in secrets)


# --- a file that may grow no further (RLIMIT_FSIZE) ----------------------------------------

FSIZE_LIMIT = 16 * 1024
FSIZE_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, resource, sys
    from pathlib import Path

    from gateway.core import receipts
    from gateway.core.receipts import ReceiptWriter
    from spark_plugins import synthetic

    receipts._FLUSH_INTERVAL = 0
    receipts._RETRY_BASE = receipts._RETRY_CAP = 0.01

    async def main(directory: Path, limit: int) -> None:
        state = {"written": 0, "failures": 0}
        progress = asyncio.Event()

        def count(key: str, n: int = 1) -> None:
            state[key] += n
            progress.set()

        writer = ReceiptWriter(
            directory,
            on_written=lambda n: count("written", n),
            on_write_failed=lambda: count("failures"),
        )
        await writer.start()
        items = list(synthetic.receipts(300, seed=3))
        # After the imports: from here on, no file of this process may pass `limit`.
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        for receipt in items:
            await writer.put(receipt)
        while state["written"] < len(items) and state["failures"] < 20:
            progress.clear()
            await progress.wait()
        await writer.close()
        print(json.dumps({**state, "lost": writer.lost}))

    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
    """
)


def test_a_file_that_may_grow_no_further_is_rolled(tmp_path: Path) -> None:
    """`ulimit -f` (or a file system's largest file) below `roll_bytes`: the write that
    reaches the limit fails with EFBIG. The writer took the batch back and tried the
    same file again, which could never take it: every receipt stayed in memory until
    shutdown counted them lost. Now the complete lines stay, the file is rolled, and
    the rest goes to new files, each no larger than the limit."""
    directory = tmp_path / "receipts"
    done = subprocess.run(
        [sys.executable, "-c", FSIZE_SCRIPT, str(directory), str(FSIZE_LIMIT)],
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    assert state["lost"] == 0 and state["written"] == 300, (state, done.stderr)
    assert state["failures"] >= 1  # the limit was reached: this tested something
    files = sorted(directory.iterdir())
    assert len(files) > 1 and all(p.suffix == ".jsonl" for p in files)
    assert all(p.stat().st_size <= FSIZE_LIMIT for p in files)
    every_line_whole(directory)
    from spark_plugins import synthetic

    expected = [receipt_record(r) for r in synthetic.receipts(300, seed=3)]
    assert read_records(directory) == expected
    assert "Traceback" not in done.stderr


# --- what /readyz and /metrics say while the disk is full ---------------------------------


async def test_readyz_and_metrics_say_the_receipts_disk_is_full_and_recover(
    small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/readyz said `ready: true` while no receipt could be written, even once the buffer
    was full and every push waited for room. Now it shows `receipts: false` at once and
    stays ready while the buffer takes the receipts; with the buffer full it answers 503
    (the store and the rest still reported as they are). /metrics counts the failed
    attempts, each is one log line without a traceback; with space back, both recover
    with no restart."""
    events = Events()

    class WatchedWriter(ReceiptWriter):
        def __init__(self, *args: Any, **options: Any) -> None:
            counted_written = options.pop("on_written")
            counted_failure = options.pop("on_write_failed")

            def on_written(n: int) -> None:
                counted_written(n)
                events.on_written(n)

            def on_write_failed() -> None:
                counted_failure()
                events.on_write_failed()

            super().__init__(
                *args, on_written=on_written, on_write_failed=on_write_failed, **options
            )

    monkeypatch.setattr(gateway.app, "ReceiptWriter", WatchedWriter)
    config = base_config(tmp_path, {})  # the store on the ordinary disk
    config["receipts"]["directory"] = str(small_disk / "receipts")
    config["receipts"]["buffer"] = 50  # 15 KB of receipts: more than a page's slack
    secrets: set[str] = set()
    items = make_receipts(20, secrets)
    more = iter(make_receipts(500, secrets))
    async with GatewayHarness(config) as gw:
        assert gw.gateway is not None
        writer = gw.gateway.runtime.receipts
        assert writer is not None
        ready = await gw.client.get("/readyz")
        assert ready.status == 200 and (await ready.json())["receipts"] is True
        filler = small_disk / "filler"
        fill(filler)
        mark = len(LOG_CAPTURE.lines)
        for receipt in items:
            await writer.put(receipt)
        await events.failure()
        ready = await gw.client.get("/readyz")
        body = await ready.json()
        assert ready.status == 200, body  # the buffer still takes receipts
        assert body["receipts"] is False and body["store"] is True
        put = len(items)
        while not writer.holding_pushes:  # fill the buffer: a put would wait now
            await writer.put(next(more))
            put += 1
        ready = await gw.client.get("/readyz")
        body = await ready.json()
        assert ready.status == 503, body
        assert body["receipts"] is False and body["store"] is True
        metrics = await (await gw.client.get("/metrics")).text()
        assert "pushgw_receipt_write_failures_total 0.0" not in metrics
        assert "pushgw_receipt_write_failures_total" in metrics

        filler.unlink()
        await events.written_reaches(put)
        ready = await gw.client.get("/readyz")
        assert ready.status == 200 and (await ready.json())["receipts"] is True
        metrics = await (await gw.client.get("/metrics")).text()
        assert f"pushgw_receipts_written_total {float(put)}" in metrics
        logged = "\n".join(LOG_CAPTURE.lines[mark:])
        assert "writing failed (No space left on device)" in logged
        assert "Traceback" not in logged
        assert not any(secret in logged for secret in secrets)


# --- a Spark job's small outputs on a full disk -------------------------------------------


def test_an_output_that_does_not_fit_leaves_no_half_written_file(small_disk: Path) -> None:
    """`result-<job>.json`, charts and pages go through a `.tmp` file renamed into place.
    On a full disk the write failed and the `.tmp` stayed, half-written, holding the
    space the disk lacked (and looking like output). Now it goes; the job's error is
    raised as before, and the earlier run's file is untouched."""
    from spark_plugins import output

    path = str(small_disk / "out" / "result-delivery-report.json")
    output.write_bytes(None, path, b"{}\n")  # type: ignore[arg-type]  # local: no session
    with pytest.raises(OSError) as raised:
        output.write_bytes(None, path, bytes(2 * DISK_SIZE))  # type: ignore[arg-type]
    assert raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (small_disk / "out").iterdir()) == ["result-delivery-report.json"]
    assert Path(path).read_bytes() == b"{}\n"
