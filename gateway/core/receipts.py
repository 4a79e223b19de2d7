"""The receipts sink: every final outcome as a JSON Lines record (see docs/receipts.md).

Records go through a bounded buffer to one writer thread, so file I/O never runs on
the event loop; files are rolled by time and size, and renamed from `.jsonl.open` to
`.jsonl` when complete so readers never see a half-written file. With the Parquet
format, a rolled file is converted to `.parquet` instead (still in the writer thread),
and kept as `.jsonl` if that fails. At start, the `.jsonl.open` files of writers that
no longer run (a crash) are finished the same way.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from gateway.config import ReceiptsFormat
from gateway.core.push import Receipt

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_FLUSH_INTERVAL = 0.25  # seconds a record may wait in memory before it is written
_STOP: dict[str, Any] = {}  # sentinel queued by close()
_OPEN_NAME = re.compile(r"receipts-\d{8}T\d{6}Z-(\d{1,9})-\d+\.jsonl\.open")
# No writer of this process can have written a file before this module was imported.
_PROCESS_STARTED = time.time()
# One encoder: `json.dumps` with any keyword argument builds a new one per record.
_encode_record = json.JSONEncoder(separators=(",", ":")).encode


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
        "reason": receipt.reason,
        "attempts": receipt.attempts,
        "latency_ms": round(receipt.latency * 1000, 3),
        "token_hash": receipt.token_hash,
    }


def finish(path: Path, file_format: ReceiptsFormat) -> None:
    """Publish the `.jsonl.open` file `path`, which nobody writes any more.

    It becomes `.jsonl`, or `.parquet` with that format; an empty file is removed.
    """
    jsonl = path.with_suffix("")  # drop ".open"
    parquet = jsonl.with_suffix(".parquet")
    if parquet.exists() or path.stat().st_size == 0:
        # A `.parquet` of the same name is only ever renamed into place complete: a crash
        # came between that rename and this removal, and the records are already in it.
        path.unlink()
    elif file_format == "parquet" and _publish_parquet(path, parquet):
        path.unlink()
    else:
        path.rename(jsonl)


def _publish_parquet(source: Path, target: Path) -> bool:
    """Convert `source` to `target` through a temporary name; False if that failed."""
    tmp = target.with_name(target.name + ".tmp")  # not `*.parquet`: readers skip it
    try:
        from gateway.core import receipts_parquet  # pyarrow is an optional dependency

        skipped = receipts_parquet.convert(source, tmp)
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


def recover(directory: Path, file_format: ReceiptsFormat) -> None:
    """Finish the `.jsonl.open` files left behind by writers that no longer run."""
    for path in sorted(directory.glob("receipts-*.jsonl.open")):
        match = _OPEN_NAME.fullmatch(path.name)
        if match is None:
            continue
        try:
            if _abandoned(path, int(match[1])):
                _recover_one(path, file_format)
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


def _recover_one(path: Path, file_format: ReceiptsFormat) -> None:
    with path.open("rb") as claim:
        # Workers of `serve --workers N` start together: one of them recovers a file.
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        if os.fstat(claim.fileno()).st_ino != path.stat().st_ino:
            return  # recovered by another worker between our open and our lock
        finish(path, file_format)
    log.info("receipts: recovered %s, left by a process that no longer runs", path.name)


class RollingFile:
    """Appends lines to `receipts-*.jsonl.open`, publishing it (`finish`) when it rolls.

    Used only from the writer thread.
    """

    def __init__(
        self,
        directory: Path,
        roll_seconds: float,
        roll_bytes: int,
        file_format: ReceiptsFormat = "jsonl",
    ) -> None:
        self.directory = directory
        self.roll_seconds = roll_seconds
        self.roll_bytes = roll_bytes
        self.file_format = file_format
        self._file: IO[str] | None = None
        self._path: Path | None = None
        self._opened = 0.0
        self._size = 0
        self._seq = 0

    def write(self, lines: list[str]) -> None:
        if self._file is not None and self._due():
            self.close()
        if self._file is None:
            self._open()
        assert self._file is not None
        chunk = "".join(lines)
        self._file.write(chunk)
        self._file.flush()
        self._size += len(chunk)

    def _due(self) -> bool:
        return self._size >= self.roll_bytes or time.time() - self._opened >= self.roll_seconds

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        start = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self._path = self.directory / f"receipts-{start}-{os.getpid()}-{self._seq:04d}.jsonl.open"
        self._file = self._path.open("a", encoding="utf-8")
        self._opened = time.time()
        self._size = 0

    def start(self) -> None:
        """Load pyarrow now rather than at the first roll, then recover crashed files."""
        if self.file_format == "parquet":
            try:
                from gateway.core import receipts_parquet  # noqa: F401
            except ImportError as exc:
                log.warning("receipts: files will stay JSON Lines: %s", exc)
        recover(self.directory, self.file_format)

    def close(self) -> None:
        if self._file is None or self._path is None:
            return
        self._file.close()
        finish(self._path, self.file_format)
        self._file = None
        self._path = None


class ReceiptWriter:
    """Bounded, asynchronous receipt writer; `put()` waits only when the buffer is full."""

    def __init__(
        self,
        directory: Path,
        *,
        roll_seconds: float = 3600.0,
        roll_bytes: int = 64 * 1024 * 1024,
        buffer: int = 50_000,
        file_format: ReceiptsFormat = "jsonl",
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        self._file = RollingFile(Path(directory), roll_seconds, roll_bytes, file_format)
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=buffer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="receipts")
        self._task: asyncio.Task[None] | None = None
        self._on_written = on_written

    async def start(self) -> None:
        """Recover what crashed writers left (in the writer thread), then start writing."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._file.start)
        self._task = asyncio.create_task(self._run(), name="receipt-writer")

    async def put(self, receipt: Receipt) -> None:
        record = receipt_record(receipt)
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            await self._queue.put(record)  # back-pressure: nothing accepted is dropped

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            batch = [await self._queue.get()]
            await asyncio.sleep(_FLUSH_INTERVAL)  # batch: one write per interval, not per record
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if batch[-1] is _STOP:
                stopping = True
                batch.pop()
            if batch:
                await loop.run_in_executor(self._executor, self._write, batch)

    def _write(self, batch: list[dict[str, Any]]) -> None:
        encode = _encode_record
        lines = [encode(r) + "\n" for r in batch]
        self._file.write(lines)
        if self._on_written:
            self._on_written(len(lines))

    async def close(self) -> None:
        """Write everything accepted so far, then close and publish the current file."""
        if self._task is not None:
            await self._queue.put(_STOP)  # after every accepted record: nothing is lost
            await self._task
            self._task = None
        await asyncio.get_running_loop().run_in_executor(self._executor, self._file.close)
        self._executor.shutdown(wait=True)
