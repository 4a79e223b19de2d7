"""The receipts sink: every final outcome as a JSON Lines record (see docs/receipts.md).

Records go through a bounded buffer to one writer thread, so file I/O never runs on
the event loop; files are rolled by time (also while no record arrives) and size, and
renamed from `.jsonl.open` to `.jsonl` when complete so readers never see a
half-written file. With the Parquet format, a rolled file is converted to `.parquet`
instead (still in the writer thread), and kept as `.jsonl` if that fails. At start, the
`.jsonl.open` files of writers that no longer run (a crash) are finished the same way.

A failed write (disk full, file too large, I/O error) or a failed publishing rename
loses nothing: the records stay in the buffer, the failure is logged (never a record)
and counted, and the writer tries again with backoff. Only `close()` gives up, after
one last attempt: it counts and logs the records it could not write, and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.config import ReceiptsFormat
from gateway.core.push import Receipt

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_FLUSH_INTERVAL = 0.25  # seconds a record may wait in memory before it is written
_RETRY_BASE = 0.5  # seconds before the first retry of a failed write; doubles per failure
_RETRY_CAP = 10.0  # longest wait between two attempts
_OPEN_NAME = re.compile(r"receipts-\d{8}T\d{6}Z-(\d{1,9})-\d+\.jsonl\.open")
# No writer of this process can have written a file before this module was imported.
_PROCESS_STARTED = time.time()
# Told the format of each file published (`ReceiptWriter`'s `on_published`).
OnPublished = Callable[[ReceiptsFormat], None]
# One encoder: `json.dumps` with any keyword argument builds a new one per record.
_encode_record = json.JSONEncoder(separators=(",", ":")).encode


def record_line(record: dict[str, Any]) -> str:
    """One record as the writer writes it: compact JSON, ASCII only, ending in a newline."""
    return _encode_record(record) + "\n"


def receipt_record(receipt: Receipt) -> dict[str, Any]:
    """The documented JSON object for one receipt (schema version 1)."""
    return {
        "v": SCHEMA_VERSION,
        "ts": round(receipt.finished_at, 6),
        "push_id": receipt.push_id,
        "plugin": receipt.plugin,
        "app_id": receipt.app_id,
        "provider": receipt.provider.value if receipt.provider else None,
        "status": receipt.outcome.value,
        "http_status": receipt.status,
        "reason": _unicode_text(receipt.reason),
        "attempts": receipt.attempts,
        "latency_ms": round(receipt.latency * 1000, 3),
        "token_hash": receipt.token_hash,
    }


def _unicode_text(text: str | None) -> str | None:
    """`text` with any lone UTF-16 surrogate as U+FFFD (a pair as its character).

    A provider's (or a proxy's) error body may escape one (`"\\ud800"`); written as it
    is, Arrow refuses the string, and the whole file stayed JSON Lines.
    """
    if text is None or text.isascii():
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def finish(path: Path, file_format: ReceiptsFormat) -> ReceiptsFormat | None:
    """Publish the `.jsonl.open` file `path`, which nobody writes any more.

    It becomes `.jsonl`, or `.parquet` with that format; an empty file is removed.
    Returns the format of the file published: `jsonl` with the Parquet format when the
    conversion failed; None when none was (an empty file, or one published already).
    """
    jsonl = path.with_suffix("")  # drop ".open"
    parquet = jsonl.with_suffix(".parquet")
    if parquet.exists() or path.stat().st_size == 0:
        # A `.parquet` of the same name is only ever renamed into place complete: a crash
        # came between that rename and this removal, and the records are already in it.
        if parquet.exists():
            _sync_directory(parquet.parent)  # its rename may not be on disk yet
        path.unlink()
        return None
    if file_format == "parquet" and _publish_parquet(path, parquet):
        # The records' only other copy goes next: the rename must survive a power loss.
        _sync_directory(parquet.parent)
        path.unlink()
        return "parquet"
    # A conversion cut short by a crash left this (the format has changed since, or
    # pyarrow is gone): nothing else would ever remove it.
    parquet.with_name(parquet.name + ".tmp").unlink(missing_ok=True)
    # Data, then name, on disk: a published file survives a power loss, as a `.parquet`.
    _sync_file(path)
    path.rename(jsonl)
    _sync_directory(jsonl.parent)
    return "jsonl"


def _publish_parquet(source: Path, target: Path) -> bool:
    """Convert `source` to `target` through a temporary name; False if that failed."""
    tmp = target.with_name(target.name + ".tmp")  # not `*.parquet`: readers skip it
    try:
        from gateway.core import receipts_parquet  # pyarrow is an optional dependency

        skipped = receipts_parquet.convert(source, tmp)
        # Data on disk before the name: else a power loss can leave a `.parquet` without
        # its data (delayed allocation), and recovery then removes the `.jsonl.open`.
        _sync_file(tmp)
        tmp.replace(target)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        # Only the kind of error: an Arrow message may quote the line it choked on.
        why = str(exc) if isinstance(exc, ImportError | OSError) else type(exc).__name__
        log.warning(
            "receipts: %s stays JSON Lines, Parquet conversion failed: %s", source.name, why
        )
        return False
    if skipped:
        log.warning(
            "receipts: %d unparsable line(s) of %s left out of %s",
            skipped,
            source.name,
            target.name,
        )
    return True


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_directory(path: Path) -> None:
    """Make the renames in `path` durable; a file system that cannot fsync a directory
    (EINVAL, ENOTSUP: some network and FUSE ones) is left to its own ordering."""
    try:
        _sync_file(path)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def recover(
    directory: Path, file_format: ReceiptsFormat, on_published: OnPublished | None = None
) -> None:
    """Finish the `.jsonl.open` files left behind by writers that no longer run."""
    for path in sorted(directory.glob("receipts-*.jsonl.open")):
        match = _OPEN_NAME.fullmatch(path.name)
        if match is None:
            continue
        try:
            if _abandoned(path, int(match[1])):
                published = _recover_one(path, file_format)
                if published is not None and on_published is not None:
                    on_published(published)
        except FileNotFoundError:
            pass  # finished meanwhile by its writer or another worker
        except OSError as exc:  # never worth refusing to start over
            log.warning("receipts: cannot recover %s: %s", path.name, exc.strerror)


def _abandoned(path: Path, pid: int) -> bool:
    if pid == os.getpid():
        # A former process with our pid (containers reuse pids) wrote it before we ran.
        return path.stat().st_mtime < _PROCESS_STARTED
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


@contextlib.contextmanager
def _claimed(path: Path) -> Iterator[bool]:
    """Whether this process alone holds `path` now (an exclusive `flock`, until the end
    of the block): its writer holds it while writing (`RollingFile`), and whoever
    publishes it holds it meanwhile. FileNotFoundError when it is gone.

    The pid in a file's name is not enough to tell a live writer: a node in another
    container (pid namespace) on the same volume has a pid that is not running here,
    or ours. The lock is the kernel's, released when its holder dies, whatever its pid.
    """
    with path.open("rb") as claim:
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False  # written, or being published, by another process
            return
        # Published by another process between our open and our lock: a new file may
        # have its name (or none has).
        yield os.fstat(claim.fileno()).st_ino == path.stat().st_ino


def _recover_one(path: Path, file_format: ReceiptsFormat) -> ReceiptsFormat | None:
    # Workers of `serve --workers N` start together: one of them recovers a file; and a
    # file whose writer still runs (in another pid namespace) is locked by it.
    with _claimed(path) as claimed:
        if not claimed:
            return None
        published = finish(path, file_format)
    log.info("receipts: recovered %s, left by a process that no longer runs", path.name)
    return published


class WriteFailed(Exception):
    """Appending a batch failed; its first `written` lines are in a file all the same."""

    def __init__(self, cause: Exception, written: int) -> None:
        super().__init__(cause)
        self.cause = cause
        self.written = written


class RollingFile:
    """Appends lines to `receipts-*.jsonl.open`, publishing it (`finish`) when it rolls.

    Used only from the writer thread. A line is appended whole or not at all: after a
    failed write the file is cut back to its last complete line, and
    `WriteFailed.written` says how many of the batch's lines it holds (a file that may
    not grow, EFBIG, is rolled then). When even the cut fails, the file is rolled as it
    is (its last line may be cut, as after a crash). A rolled file
    whose publishing fails stays in `unpublished` and is retried by `publish()`.
    """

    def __init__(
        self,
        directory: Path,
        roll_seconds: float,
        roll_bytes: int,
        file_format: ReceiptsFormat = "jsonl",
        on_published: OnPublished | None = None,
    ) -> None:
        self.directory = directory
        self.roll_seconds = roll_seconds
        self.roll_bytes = roll_bytes
        self.file_format = file_format
        self.on_published = on_published
        self.unpublished: list[Path] = []
        self._fd: int | None = None
        self._path: Path | None = None
        self._opened = 0.0  # time.monotonic() at open
        self._size = 0  # bytes of complete batches
        self._seq = 0

    def write(self, lines: list[str]) -> None:
        """Append `lines`, each ending in a newline; raise `WriteFailed` or OSError."""
        self.roll_if_due()
        if self._fd is None:
            self._open()
        assert self._fd is not None
        data = "".join(lines).encode()
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):
                done += self._write_some(self._fd, view[done:])
        except OSError as exc:
            raise self._cut_back(data, done, exc) from exc
        self._size += len(data)

    def _cut_back(self, data: bytes, done: int, exc: OSError) -> WriteFailed:
        """Take back the cut line of a failed batch; its complete lines stay written.

        Keeping them is what lets a backlog drain when space returns: a backlog larger
        than the space freed (or than the file may grow) was taken back whole at each
        attempt, and the writer never wrote another record.
        """
        assert self._fd is not None
        kept = data.rfind(b"\n", 0, done) + 1  # bytes of the complete lines written
        try:
            self._truncate(self._fd, self._size + kept)
        except OSError:
            with contextlib.suppress(OSError):
                self._detach()  # queued for publishing all the same
            return WriteFailed(exc, data.count(b"\n", 0, done))
        self._size += kept
        if exc.errno == errno.EFBIG:
            # The file cannot grow (RLIMIT_FSIZE, the file system's largest file): the
            # next attempt goes to a new one, not to this one again for ever.
            with contextlib.suppress(OSError):
                self._detach()
        return WriteFailed(exc, data.count(b"\n", 0, kept))

    # The file operations, one place each (tests put failures here).
    @staticmethod
    def _write_some(fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    @staticmethod
    def _truncate(fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    @staticmethod
    def _publish(path: Path, file_format: ReceiptsFormat) -> ReceiptsFormat | None:
        return finish(path, file_format)

    def _due(self) -> bool:
        return self._size >= self.roll_bytes or time.monotonic() - self._opened >= self.roll_seconds

    def due_in(self) -> float | None:
        """Seconds until the open file must roll; None when no file is open."""
        if self._fd is None:
            return None
        if self._size >= self.roll_bytes:
            return 0.0
        return max(self._opened + self.roll_seconds - time.monotonic(), 0.0)

    def roll_if_due(self) -> None:
        if self._fd is not None and self._due():
            self._detach()

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        start = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        while True:
            # A name an earlier writer with our pid took in the same second (a writer
            # restarted in this process, a container's pid 1 restarted) is skipped:
            # publishing would replace its file (jsonl) or take ours for a leftover of
            # its `.parquet` and remove it. Created first, then checked, so that a file
            # renamed meanwhile is seen one way or the other.
            self._seq += 1
            stem = f"receipts-{start}-{os.getpid()}-{self._seq:04d}"
            path = self.directory / f"{stem}.jsonl.open"
            try:
                fd = os.open(path, flags, 0o666)
            except FileExistsError:
                continue
            if any((self.directory / f"{stem}{s}").exists() for s in (".jsonl", ".parquet")):
                os.close(fd)
                path.unlink()
                continue
            try:
                # Held while we write it: recovery elsewhere leaves it alone (`_claimed`).
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # a recovery claimed it, empty: it removes it
                continue
            break
        self._fd = fd
        self._path = path
        self._opened = time.monotonic()
        self._size = 0

    def _detach(self) -> None:
        """Stop writing the open file and queue it for publishing."""
        fd, path = self._fd, self._path
        self._fd = self._path = None
        if path is not None:
            self.unpublished.append(path)
        if fd is not None:
            os.close(fd)  # the descriptor is released even when this raises

    def publish(self) -> None:
        """Publish every rolled file (`finish`); raise the first error, keeping the files
        that failed for the next call."""
        error: OSError | None = None
        for path in list(self.unpublished):
            published = None
            try:
                with _claimed(path) as claimed:
                    # Not claimed: another process publishes it (a recovery that took
                    # it for a crashed writer's, as the lock is let go between our
                    # write and this claim).
                    if claimed:
                        published = self._publish(path, self.file_format)
            except FileNotFoundError:
                pass  # published by hand meanwhile
            except OSError as exc:
                error = error or exc
                continue
            self.unpublished.remove(path)
            if published is not None and self.on_published is not None:
                self.on_published(published)
        if error is not None:
            raise error

    def start(self) -> None:
        """Load pyarrow now rather than at the first roll, then recover crashed files."""
        if self.file_format == "parquet":
            try:
                from gateway.core import receipts_parquet  # noqa: F401
            except ImportError as exc:
                log.warning("receipts: files will stay JSON Lines: %s", exc)
        recover(self.directory, self.file_format, self.on_published)

    def close(self) -> None:
        """Roll the open file and publish every rolled one; raise if one stays unpublished."""
        if self._fd is not None:
            self._detach()
        self.publish()


class ReceiptWriter:
    """Bounded, asynchronous receipt writer; `put()` waits only when the buffer is full.

    `on_written(n)`, `on_write_failed()` and `on_lost(n)` (metrics) are called on the
    event loop: n records written; one failed attempt to write or publish (retried);
    n accepted records given up at `close()` because writing still failed.
    `on_published(format)` is called in the writer thread (a Prometheus counter is
    thread-safe) for each file published, crashed writers' included, with its format:
    `jsonl` with the Parquet format means its conversion failed.
    """

    def __init__(
        self,
        directory: Path,
        *,
        roll_seconds: float = 3600.0,
        roll_bytes: int = 64 * 1024 * 1024,
        buffer: int = 50_000,
        file_format: ReceiptsFormat = "jsonl",
        on_written: Callable[[int], None] | None = None,
        on_write_failed: Callable[[], None] | None = None,
        on_lost: Callable[[int], None] | None = None,
        on_published: OnPublished | None = None,
    ) -> None:
        self._file = RollingFile(
            Path(directory), roll_seconds, roll_bytes, file_format, on_published
        )
        self._capacity = buffer
        # Accepted records not yet written, oldest first. Only the writer loop removes
        # them, and only once they are in a file.
        self._records: deque[dict[str, Any]] = deque()
        self._wake = asyncio.Event()  # records arrived, or close() began
        self._space = asyncio.Event()  # the writer made room in the buffer
        self._closing = asyncio.Event()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="receipts")
        self._task: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None  # the one closing, see close()
        self._on_written = on_written
        self._on_write_failed = on_write_failed
        self._on_lost = on_lost
        self.lost = 0  # accepted records that were never written
        self.failing = False  # the last attempt to write or publish failed (/readyz)

    @property
    def holding_pushes(self) -> bool:
        """Writing fails and the buffer is full: every push waits for room (/readyz)."""
        return self.failing and len(self._records) >= self._capacity

    async def start(self) -> None:
        """Recover what crashed writers left (in the writer thread), then start writing."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._file.start)
        self._task = asyncio.create_task(self._run(), name="receipt-writer")

    async def put(self, receipt: Receipt) -> None:
        record = receipt_record(receipt)
        while len(self._records) >= self._capacity and not self._closed:
            self._space.clear()
            await self._space.wait()  # back-pressure: nothing accepted is dropped
        if self._closed:
            self._lose(1, "arrived after the writer closed")
            return
        self._records.append(record)
        self._wake.set()

    async def _run(self) -> None:
        failures = 0
        while True:
            if failures:
                await _wait(self._closing, _retry_delay(failures))
            elif not self._records and not self._closing.is_set():
                self._wake.clear()
                # Wake for records, for close(), or when the open file is due to roll.
                await _wait(self._wake, self._file.due_in())
                if self._records:
                    await _wait(self._closing, _FLUSH_INTERVAL)  # one write per interval
            else:
                await _wait(self._closing, _FLUSH_INTERVAL)
            closing = self._closing.is_set()  # then this is the last attempt
            error = await self._flush()
            self.failing = error is not None
            if error is None:
                if failures:
                    log.warning("receipts: writing again after %d failed attempt(s)", failures)
                failures = 0
                if closing and not self._records:
                    return
                continue
            failures += 1
            if self._on_write_failed is not None:
                self._on_write_failed()
            if closing:
                log.warning("receipts: writing failed at shutdown (%s), giving up", _why(error))
                return
            log.warning(
                "receipts: writing failed (%s); %d record(s) kept in memory, "
                "next attempt in %.1f s (failure %d)",
                _why(error),
                len(self._records),
                _retry_delay(failures),
                failures,
            )

    async def _flush(self) -> Exception | None:
        """Write the buffered records, roll the file if due and publish rolled files (in
        the writer thread); the error of a step that failed, else None."""
        records = self._records
        batch = list(itertools.islice(records, len(records)))
        loop = asyncio.get_running_loop()
        written, error = await loop.run_in_executor(self._executor, self._step, batch)
        if written:
            for _ in range(written):
                records.popleft()
            self._space.set()
            if self._on_written is not None:
                self._on_written(written)
        return error

    def _step(self, batch: list[dict[str, Any]]) -> tuple[int, Exception | None]:
        """Writer thread: (records written, the first error)."""
        written, error = 0, None
        try:
            if batch:
                self._file.write([record_line(r) for r in batch])
                written = len(batch)
            self._file.roll_if_due()
        except WriteFailed as exc:
            written, error = exc.written, exc.cause
        except Exception as exc:
            error = exc
        try:
            self._file.publish()
        except Exception as exc:
            error = error or exc
        return written, error

    async def close(self) -> None:
        """Write everything accepted so far, then close and publish the current file.

        Never hangs on a failing disk: after one last attempt, the records still
        unwritten are counted (`on_lost`) and logged, and a file that cannot be
        published stays `.jsonl.open` for the next start to publish (see `recover`).

        Cancelling close() does not cut the closing short: it goes on in its own task,
        and the next close() waits for it. (A writer cancelled mid-write would leave its
        batch both in the file and in the buffer, and the current file unpublished.)
        """
        if self._closer is None:
            self._closer = asyncio.create_task(self._close(), name="receipt-writer-close")
        await asyncio.shield(self._closer)

    async def _close(self) -> None:
        self._closing.set()
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except Exception as exc:  # a bug in the loop: still close, still count
                log.error("receipts: the writer failed: %s", type(exc).__name__)
            self._task = None
        self._closed = True
        self._space.set()  # a put() waiting for room now counts its record as lost
        if self._records:
            self._lose(len(self._records), "could not be written")
            self._records.clear()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._file.close)
        except Exception as exc:
            log.warning(
                "receipts: %d file(s) stay .jsonl.open (%s); the next start publishes them",
                len(self._file.unpublished),
                _why(exc),
            )
        self._executor.shutdown(wait=True)

    def _lose(self, count: int, why: str) -> None:
        self.lost += count
        if self._on_lost is not None:
            self._on_lost(count)
        log.error("receipts: %d accepted receipt record(s) %s and are lost", count, why)


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    """Until `event` is set or `timeout` seconds passed (None: no limit)."""
    if event.is_set():
        return
    if timeout is None:
        await event.wait()
        return
    if timeout <= 0:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


def _retry_delay(failures: int) -> float:
    # The exponent is capped: past 2 ** 1023 the float conversion overflows, and a disk
    # full for ~3 h (1,025 failures, every 10 s) killed the writer with OverflowError.
    return min(_RETRY_CAP, _RETRY_BASE * 2 ** min(failures - 1, 64))


def _why(error: BaseException) -> str:
    """The kind of a write error, for the log: never a record."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return type(error).__name__
