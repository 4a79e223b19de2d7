"""The receipts sink: every final outcome as a JSON Lines record (see docs/receipts.md).

Records go through a bounded buffer to one writer thread, so file I/O never runs on
the event loop; files are rolled by time and size, and renamed from `.jsonl.open` to
`.jsonl` when complete so readers never see a half-written file.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from gateway.core.push import Receipt

SCHEMA_VERSION = 1
_FLUSH_INTERVAL = 0.25  # seconds a record may wait in memory before it is written
_STOP: dict[str, Any] = {}  # sentinel queued by close()


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


class RollingFile:
    """Appends lines to `receipts-*.jsonl.open`, renaming it to `.jsonl` when it rolls.

    Used only from the writer thread.
    """

    def __init__(self, directory: Path, roll_seconds: float, roll_bytes: int) -> None:
        self.directory = directory
        self.roll_seconds = roll_seconds
        self.roll_bytes = roll_bytes
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

    def close(self) -> None:
        if self._file is None or self._path is None:
            return
        self._file.close()
        final = self._path.with_suffix("")  # drop ".open"
        if self._size:
            self._path.rename(final)
        else:
            self._path.unlink(missing_ok=True)
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
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        self._file = RollingFile(Path(directory), roll_seconds, roll_bytes)
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=buffer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="receipts")
        self._task: asyncio.Task[None] | None = None
        self._on_written = on_written

    async def start(self) -> None:
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
        lines = [json.dumps(r, separators=(",", ":")) + "\n" for r in batch]
        self._file.write(lines)
        if self._on_written:
            self._on_written(len(lines))

    async def close(self) -> None:
        """Write everything accepted so far, then close and rename the current file."""
        if self._task is not None:
            await self._queue.put(_STOP)  # after every accepted record: nothing is lost
            await self._task
            self._task = None
        await asyncio.get_running_loop().run_in_executor(self._executor, self._file.close)
        self._executor.shutdown(wait=True)
