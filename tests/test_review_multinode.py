"""Several gateway nodes (separate `pushgw` processes) sharing one PostgreSQL database."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.core.store import Store, migration_lock_path
from tests.conftest import SAMPLE_PLUGIN_DIR, install_plugin_dist

PUSHGW = [sys.executable, "-m", "gateway.cli"]
WAIT = 60.0  # seconds a test waits for a condition before failing


def node_env(url: str, site: Path, enabled: Sequence[str] = ("zulip", "sample")) -> dict[str, str]:
    """The environment of one gateway node: the shared database, zulip and the sample
    plugin (installed as a distribution) enabled; nothing else of pushgw's."""
    install_plugin_dist(site, "sample")
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    paths = [str(site), str(SAMPLE_PLUGIN_DIR), os.getcwd(), clean.get("PYTHONPATH", "")]
    return {
        **clean,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PUSHGW__STORE__URL": url,
        "PUSHGW__PLUGINS__ENABLED": json.dumps(list(enabled)),
    }


@contextlib.contextmanager
def running_upgrades(env: dict[str, str], count: int = 2) -> Iterator[list[subprocess.Popen[str]]]:
    """`count` processes running `pushgw db upgrade` at once, as nodes starting together;
    any still running at the end is killed."""
    procs = [
        subprocess.Popen(
            [*PUSHGW, "db", "upgrade"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def assert_all_at_head(procs: Sequence[subprocess.Popen[str]], dialect: str) -> None:
    """Each process ends with status 0, saying the database is at head."""
    for proc in procs:
        out, err = proc.communicate(timeout=WAIT)
        assert proc.returncode == 0, err
        assert out.startswith(f"database at head ({dialect})"), out


async def lock_waiters(conn: AsyncConnection, database: str) -> int:
    """Sessions of other processes on `database` waiting for a lock."""
    result = await conn.execute(
        text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = :db "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        ),
        {"db": database},
    )
    return int(result.scalar_one())


async def wait_for_waiters(
    waiters: Callable[[], Awaitable[int]], count: int, procs: Sequence[subprocess.Popen[str]]
) -> None:
    """Until `count` processes wait for a lock (as the database or the kernel reports
    them: polled); fails at once when a process ended meanwhile."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while await waiters() < count:
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"a node ended before it waited: {proc.returncode} {out} {err}")
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"{count} nodes did not come to wait on the database")
        await asyncio.sleep(0.05)


async def tables(store: Store) -> set[str]:
    async with store.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


# --- migrations ------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("start", ["empty", "core-only"])
async def test_nodes_migrating_at_once_both_start(
    postgres_url: str, tmp_path: Path, start: str
) -> None:
    """Two nodes that migrate the same database at the same moment both succeed.

    The moment is made certain: a transaction of the test holds the database as a node
    mid-migration would (an uncommitted `alembic_version` on an empty database; the
    version table locked on a database where only the core's branch was applied, as
    when the plugins are enabled later) until both nodes wait for it. Both then read
    the same schema state; before the fix both went on to create the same tables and
    one failed (`duplicate key value violates unique constraint "pg_type_typname_nsp_
    index"`, `relation "zulip_servers" already exists`), its node refusing to start.
    """
    store = Store(postgres_url)
    monitor_store = Store(postgres_url)
    database = store.engine.url.database
    assert database is not None
    try:
        if start == "core-only":
            await store.upgrade()
        env = node_env(postgres_url, tmp_path / "site")
        async with store.engine.connect() as holder, monitor_store.engine.connect() as monitor:
            await monitor.execution_options(isolation_level="AUTOCOMMIT")
            await holder.begin()
            if start == "empty":
                await holder.execute(
                    text("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
                )
            else:
                await holder.execute(text("LOCK TABLE alembic_version IN ACCESS EXCLUSIVE MODE"))
            with running_upgrades(env) as procs:
                await wait_for_waiters(lambda: lock_waiters(monitor, database), 2, procs)
                await holder.rollback()  # the other "node" gave up: both go on
                assert_all_at_head(procs, "postgresql")
        assert {
            "alembic_version",
            "pushgw_invalid_tokens",
            "zulip_servers",
            "sample_invalid",
        } <= await tables(store)
        async with store.engine.connect() as conn:
            heads = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars()
            # core_0001: their base; core_0002: the core's head
            assert sorted(heads) == ["core_0002", "sample_0001", "zulip_0004"]
    finally:
        await store.close()
        await monitor_store.close()


async def flock_waiters(path: Path) -> int:
    """Processes waiting for an exclusive `flock` of `path`, as the kernel lists them
    (`/proc/locks`: a waiter's line has `->`; the file is `major:minor:inode`)."""
    inode = path.stat().st_ino
    count = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[2] == "FLOCK" and fields[6].endswith(f":{inode}"):
            count += 1
    return count


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")
async def test_commands_migrating_one_sqlite_database_at_once_take_turns(tmp_path: Path) -> None:
    """Two processes migrating one new SQLite database (`serve` and a cron command with
    `store.auto_upgrade`, say) take turns on a lock next to it and both succeed.

    The moment is made certain: the test holds the lock, as a migration in progress
    would, until both wait for it (the kernel lists them). Before, nothing made them
    wait: each created the tables, and one failed (`table ... already exists`).
    """
    url = f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"
    lock_path = migration_lock_path(url)
    assert lock_path is not None
    env = node_env(url, tmp_path / "site")
    with lock_path.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with running_upgrades(env) as procs:
            await wait_for_waiters(lambda: flock_waiters(lock_path), 2, procs)
            fcntl.flock(held, fcntl.LOCK_UN)
            assert_all_at_head(procs, "sqlite")
    store = Store(url)
    try:
        assert {"pushgw_invalid_tokens", "zulip_servers", "sample_invalid"} <= await tables(store)
    finally:
        await store.close()


# --- a node that does not migrate (store.auto_upgrade: false) --------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.postgres
@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("start", ["empty", "core-only"])
async def test_a_node_that_does_not_migrate_refuses_a_database_not_at_head(
    postgres_url: str, tmp_path: Path, start: str, workers: str
) -> None:
    """With `store.auto_upgrade: false` (nodes migrated once, by `pushgw db upgrade`), a
    node started before that upgrade ran says so in one line and exits 1, as every other
    command does. It used to check only that the database answers: it started, /readyz
    said ready, and each request touching the missing tables was a 500."""
    store = Store(postgres_url)
    try:
        if start == "core-only":
            await store.upgrade()  # the zulip and sample branches are not applied
    finally:
        await store.close()
    env = {**node_env(postgres_url, tmp_path / "site"), "PUSHGW__STORE__AUTO_UPGRADE": "false"}
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--port", str(free_port()), "--workers", workers],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # ends at exit, or at the server's announcement
            lines.append(line)
            if "Running on http://" in line:
                break
        err = "".join(lines)
        assert "Running on http://" not in err, "the node served a database not at head"
        assert proc.wait(timeout=WAIT) == 1, err
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=WAIT)
    pending = "sample_0001, zulip_0001, zulip_0002, zulip_0003, zulip_0004"
    if start == "empty":
        pending = f"core_0001, core_0002, {pending}"
    assert err.endswith(
        f"pushgw: error: database {postgres_url}: not migrated ({pending} pending) and "
        "store.auto_upgrade is false: run `pushgw db upgrade`\n"
    ), err


# --- receipts: nodes sharing a directory -----------------------------------------------

# Node A: a receipt writer in a process of its own, under a pid that no process of this
# pid namespace has (as a node in another container on the same volume appears): it
# writes one receipt, says so, waits for a line on stdin, writes a second one and closes.
OTHER_NAMESPACE_NODE = """
import asyncio, os, sys
os.getpid = lambda: 999999999  # the pid another container's node has
from gateway.core.push import Outcome, Receipt
from gateway.core.receipts import ReceiptWriter

def receipt(push_id):
    return Receipt(push_id, "sample", "ios", None, Outcome.OK, 200, None, 1, 0.01, 1.7e9)

async def main():
    written = asyncio.Event()
    writer = ReceiptWriter(sys.argv[1], file_format="parquet", on_written=lambda n: written.set())
    await writer.start()
    await writer.put(receipt("first"))
    await written.wait()  # in its .jsonl.open file
    print("written", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await writer.put(receipt("second"))
    await writer.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
async def test_a_starting_node_leaves_another_live_nodes_receipt_file_alone(
    tmp_path: Path, file_format: str
) -> None:
    """A node starting in a receipts directory that a live node of another pid namespace
    writes into (two containers sharing a volume): that node's `.jsonl.open` file carries
    a pid that is not running here, and recovery took it for a crashed writer's. It
    published it under the live writer: with Parquet the file was converted and removed,
    and every receipt the live node wrote afterwards went to the removed file (lost);
    with JSON Lines it was published while still being written."""
    from gateway.core.receipts import ReceiptWriter
    from gateway.receipt_files import read_records

    directory = tmp_path / "receipts"
    directory.mkdir()
    node_a = subprocess.Popen(
        [sys.executable, "-c", OTHER_NAMESPACE_NODE, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert node_a.stdout is not None and node_a.stdin is not None
        assert node_a.stdout.readline() == "written\n"
        (live,) = directory.glob("*.jsonl.open")
        assert "-999999999-" in live.name
        node_b = ReceiptWriter(directory, file_format=file_format)  # type: ignore[arg-type]
        await node_b.start()  # recovers what crashed writers left
        await node_b.close()
        assert live.exists(), "node B published node A's live file"
        assert list(directory.glob("*.jsonl")) + list(directory.glob("*.parquet")) == []
        node_a.stdin.write("go on\n")
        node_a.stdin.close()
        assert node_a.wait(timeout=WAIT) == 0
    finally:
        if node_a.poll() is None:
            node_a.kill()
            node_a.communicate()
    assert sorted(r["push_id"] for r in read_records(directory)) == ["first", "second"]
    assert list(directory.glob("*.open")) == []
