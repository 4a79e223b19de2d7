"""What a gateway killed with SIGKILL (an OOM kill, `kill -9`) leaves behind, and what the
next start makes of it: receipts files, invalid-token records, the SQLite store.

Each test runs the code under test in a real child process, which says on its stdout
when it reached the moment under test and then waits there; the test kills it with
SIGKILL at once. No sleeps, no timing.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway.core import receipts as receipts_module
from gateway.core.receipts import ReceiptsFormat, ReceiptWriter
from gateway.receipt_files import read_records

ROOT = Path(__file__).resolve().parent.parent
N = 300  # receipts the killed writer had written

# The child: a receipts writer that writes N receipts, then is held at the moment named
# by argv[3] (it prints "ready" there, and waits to be killed).
WRITER_CHILD = """
import asyncio, sys, threading
from pathlib import Path

from gateway.core import receipts, receipts_parquet
from gateway.core.receipts import ReceiptWriter, RollingFile
from spark_plugins import synthetic

directory, file_format, moment, n = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
receipts._FLUSH_INTERVAL = 0


def held() -> None:
    print("ready", flush=True)
    threading.Event().wait()  # until SIGKILL


if moment == "mid-write":  # a batch half in the file
    def write_some(fd, data):
        import os
        os.write(fd, data[: len(data) // 2])
        held()
    RollingFile._write_some = staticmethod(write_some)
elif moment == "mid-conversion":  # the .parquet.tmp half written
    convert = receipts_parquet.convert
    def half_converted(source, target):
        convert(source, target)
        with open(target, "r+b") as tmp:
            tmp.truncate(tmp.seek(0, 2) // 2)
        held()
    receipts_parquet.convert = half_converted
elif moment == "converted":  # the .parquet in place, its .jsonl.open not yet removed
    receipts._sync_directory = lambda path: held()
elif moment == "renamed":  # a .jsonl published, the process still running
    finish = receipts.finish
    def finished(path, fmt):
        published = finish(path, fmt)
        held()
        return published
    receipts.finish = finished


async def main() -> None:
    written = 0
    done = asyncio.Event()
    def on_written(count: int) -> None:
        nonlocal written
        written += count
        if written >= n:
            done.set()
    writer = ReceiptWriter(directory, file_format=file_format, on_written=on_written)
    await writer.start()
    for receipt in synthetic.receipts(n, seed=3):
        await writer.put(receipt)
    if moment == "written":
        await done.wait()
        held()
    elif moment == "mid-write":
        await asyncio.Event().wait()
    else:
        await done.wait()
        await writer.close()  # rolls and publishes: held on the way
    raise SystemExit("not held")


asyncio.run(main())
"""


def _spawn(tmp_path: Path, script: str, *args: str) -> subprocess.Popen[str]:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_when_ready(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child once it said it reached the moment under test."""
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line != "ready\n":
            proc.wait(timeout=60)
            raise AssertionError(f"child never got there: {proc.stderr.read()}")  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _kill_writer(tmp_path: Path, directory: Path, file_format: str, moment: str) -> None:
    proc = _spawn(tmp_path, WRITER_CHILD, str(directory), file_format, moment, str(N))
    _kill_when_ready(proc)


async def _restart(directory: Path, file_format: ReceiptsFormat) -> None:
    """What the next `pushgw serve` does with the directory: recover, write, close."""
    writer = ReceiptWriter(directory, file_format=file_format)
    await writer.start()
    await writer.close()


def _expected_ids() -> list[str]:
    from spark_plugins import synthetic

    return [receipt.push_id for receipt in synthetic.receipts(N, seed=3)]


def _cat(directory: Path) -> list[dict[str, object]]:
    """`pushgw receipts cat DIR`: exit 0, nothing on stderr, every line JSON."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "receipts", "cat", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (0, "")
    return [json.loads(line) for line in result.stdout.splitlines()]


def _files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


@pytest.mark.parametrize(
    ("killed_as", "moment", "restarted_as"),
    [
        ("jsonl", "written", "jsonl"),
        ("parquet", "written", "parquet"),
        ("parquet", "mid-conversion", "parquet"),
        ("parquet", "converted", "parquet"),
        ("parquet", "converted", "jsonl"),
        ("jsonl", "renamed", "jsonl"),
        # the format changed across the crash (or pyarrow gone): a conversion's
        # temporary file must not be left behind for ever
        ("parquet", "mid-conversion", "jsonl"),
    ],
)
async def test_receipts_written_before_a_sigkill_are_published_once(
    tmp_path: Path, killed_as: str, moment: str, restarted_as: ReceiptsFormat
) -> None:
    directory = tmp_path / "receipts"
    _kill_writer(tmp_path, directory, killed_as, moment)
    await _restart(directory, restarted_as)
    files = _files(directory)
    assert len(files) == 1, files  # no .jsonl.open, no .parquet.tmp, no second copy
    assert files[0].endswith((".jsonl", ".parquet"))
    assert [r["push_id"] for r in read_records(directory)] == _expected_ids()
    if moment != "written":
        return
    assert [r["push_id"] for r in _cat(directory)] == _expected_ids()


@pytest.mark.parametrize("restarted_as", ["jsonl", "parquet"])
async def test_a_batch_cut_by_a_sigkill_loses_only_its_cut_line(
    tmp_path: Path, restarted_as: ReceiptsFormat
) -> None:
    directory = tmp_path / "receipts"
    _kill_writer(tmp_path, directory, "jsonl", "mid-write")
    # What the killed process left: readers see nothing of it yet, and say so cleanly.
    (left,) = _files(directory)
    assert left.endswith(".jsonl.open")
    assert _cat(directory) == []
    await _restart(directory, restarted_as)
    (published,) = _files(directory)
    expected = _expected_ids()
    if restarted_as == "parquet":
        ids = [r["push_id"] for r in _cat(directory)]
    else:
        # `cat` gives a JSON Lines file as it is: its cut last line too (docs/cli.md)
        lines = (directory / published).read_text().splitlines()
        ids = [json.loads(line)["push_id"] for line in lines[:-1]]
        with pytest.raises(ValueError):
            json.loads(lines[-1])
    # a prefix of what was put, each once: the receipts after the cut are lost
    assert 0 < len(ids) < N
    assert ids == expected[: len(ids)]


async def test_a_published_jsonl_file_is_on_disk_before_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/receipts.md: a published file survives a power loss. For a `.jsonl` file,
    its data is synced before the rename, and the rename after it."""
    directory = tmp_path / "receipts"
    directory.mkdir()
    path = directory / "receipts-20250101T000000Z-1-0001.jsonl.open"
    path.write_text('{"v":1}\n')
    events: list[str] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd: int) -> None:
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self: Path, target: Path) -> Path:
        events.append(f"rename {self.name}")
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    assert receipts_module.finish(path, "jsonl") == "jsonl"
    assert events == [f"fsync {path.name}", f"rename {path.name}", "fsync receipts"]


# --- invalid tokens and the store --------------------------------------------------------

# The child: one token-invalid answer handled by the one invalidation path, killed at the
# moment argv[2] names: "mid-transaction" (its record inserted, not committed: for
# PostgreSQL, the connection cut mid-transaction), "before-hook" (recorded, the plugin
# not yet told).
TOKENS_CHILD = """
import asyncio, sys, threading
from datetime import UTC, datetime

from sqlalchemy.dialects import postgresql, sqlite

from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken, ProviderKind
from gateway.core.store import Store, invalid_tokens
from gateway.core.tokens import TokenInvalidation

url, moment = sys.argv[1], sys.argv[2]
INVALID = InvalidToken("p", "app", "ab" * 32, "tok", ProviderKind.FCM, "UNREGISTERED")


def held() -> None:
    print("ready", flush=True)
    threading.Event().wait()  # until SIGKILL


async def main() -> None:
    store = Store(url)
    if moment == "mid-transaction":
        insert = postgresql.insert if store.dialect == "postgresql" else sqlite.insert
        other = {"plugin": "p", "app_id": "app", "provider": "fcm", "reason": "x"}
        async with store.engine.begin() as conn:  # committed
            await conn.execute(
                insert(invalid_tokens).values(
                    token_hash="cd" * 32, invalidated_at=datetime.now(UTC), **other
                )
            )
        async with store.engine.begin() as conn:
            await conn.execute(
                insert(invalid_tokens).values(
                    token_hash=INVALID.token_hash,
                    invalidated_at=datetime.now(UTC),
                    **other,
                )
            )
            held()
    async def notify(invalid: InvalidToken) -> None:
        held()
    await TokenInvalidation(store, Metrics(), notify).handle(INVALID)
    raise SystemExit("not held")


asyncio.run(main())
"""


@pytest.mark.parametrize("moment", ["mid-transaction", "before-hook"])
async def test_a_token_invalidation_cut_by_a_sigkill_is_done_at_the_next_failure(
    tmp_path: Path, store_url: str, moment: str
) -> None:
    from sqlalchemy import select

    from gateway.core.metrics import Metrics
    from gateway.core.push import InvalidToken, ProviderKind
    from gateway.core.store import Store, invalid_tokens
    from gateway.core.tokens import TokenInvalidation

    store = Store(store_url)
    try:
        await store.upgrade()
        _kill_when_ready(_spawn(tmp_path, TOKENS_CHILD, store_url, moment))
        if store.dialect == "sqlite":
            # The WAL the killed process left is recovered: the database is whole, the
            # committed transaction in it, the one cut short not.
            database = store_url.split("///", 1)[1]
            with sqlite3.connect(database) as db:
                assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        async with store.engine.connect() as conn:
            hashes = (await conn.execute(select(invalid_tokens.c.token_hash))).scalars().all()
        dead = "ab" * 32
        # mid-transaction: only the committed row; before-hook: the record is in
        assert hashes == (["cd" * 32] if moment == "mid-transaction" else [dead])
        told: list[InvalidToken] = []

        async def notify(invalid: InvalidToken) -> None:
            told.append(invalid)

        # The next token-invalid answer for the token (the plugin still has it): recorded,
        # and the plugin told, once.
        invalid = InvalidToken("p", "app", dead, "tok", ProviderKind.FCM, "UNREGISTERED")
        outcome = await TokenInvalidation(store, Metrics(), notify).handle(invalid)
        assert outcome.complete
        assert told == [invalid]
        async with store.engine.connect() as conn:
            hashes = (await conn.execute(select(invalid_tokens.c.token_hash))).scalars().all()
        assert hashes.count(dead) == 1
    finally:
        await store.close()


# --- a chat server's request cut by a SIGKILL -----------------------------------------------

# `pushgw serve`, its APNs client standing in for Apple: each push it "delivers" is a line
# in $REVIEW_DELIVERED; with $REVIEW_HOLD, the process is then held (Apple has accepted
# the push, the gateway has not answered the homeserver yet).
SERVE_CHILD = """
import os, sys, threading

from gateway.cli import main
from gateway.core import apns
from gateway.core.push import Attempt, Outcome


async def send(self, push):
    with open(os.environ["REVIEW_DELIVERED"], "a") as delivered:
        delivered.write(push.id + "\\n")
    if os.environ.get("REVIEW_HOLD"):
        print("ready", flush=True)
        threading.Event().wait()  # until SIGKILL
    return Attempt(Outcome.OK, 200)


apns.ApnsClient.send = send
sys.exit(main(sys.argv[1:]))
"""

NOTIFY = {
    "notification": {
        "event_id": "$event",
        "room_id": "!room:example.org",
        "counts": {"unread": 1},
        "devices": [
            {"app_id": "com.example.app", "pushkey": "q80=" * 8, "pushkey_ts": 1},
        ],
    }
}


def _serve(tmp_path: Path, config: Path, port: int, hold: bool) -> subprocess.Popen[str]:
    path = tmp_path / "serve.py"
    path.write_text(SERVE_CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REVIEW_DELIVERED": str(tmp_path / "sent")}
    env.pop("PUSHGW_CONFIG", None)
    if hold:
        env["REVIEW_HOLD"] = "1"
    proc = subprocess.Popen(
        [sys.executable, str(path), "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # until it listens
        seen.append(line)
        if "Running on" in line:
            return proc
    proc.wait()
    raise AssertionError("pushgw serve did not start: " + "".join(seen))


def _notify(port: int) -> tuple[int, object]:
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/_matrix/push/v1/notify",
        data=json.dumps(NOTIFY).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, json.loads(response.read())


def test_a_notify_cut_by_a_sigkill_is_a_connection_error_and_its_retry_sends_again(
    tmp_path: Path,
) -> None:
    """At least once (docs/delivery.md, "After a crash"): the homeserver gets no answer,
    retries, and the device gets the notification twice; one receipt, of the retry."""
    import concurrent.futures
    import http.client
    import socket

    import yaml

    from tests.conftest import offline_apns_app

    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {"directory": str(tmp_path / "receipts"), "format": "jsonl"},
                "plugins": {
                    "enabled": ["matrix"],
                    "matrix": {"apps": {"com.example.app": offline_apns_app(tmp_path)}},
                },
            }
        )
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    killed = _serve(tmp_path, config, port, hold=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_notify, port)
        _kill_when_ready(killed)
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            answer.result()
    restarted = _serve(tmp_path, config, port, hold=False)
    try:
        assert _notify(port) == (200, {"rejected": []})  # the homeserver's retry
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.communicate(timeout=60)
    first, second = (tmp_path / "sent").read_text().splitlines()
    assert first != second  # two pushes, two push ids: the device is woken twice
    assert [r["push_id"] for r in read_records(tmp_path / "receipts")] == [second]
