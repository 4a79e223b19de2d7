"""`pushgw serve --workers N` run as real processes against the APNs simulator: every
worker serves and delivers, /metrics adds them up, what runs once per node runs once, a
crashed worker stops the gateway, SIGTERM drains every worker. Found by review, each
finding with a failing test first. No sleeps stand in for synchronisation: the tests
wait on the gateway's own lines, its files, its answers or its exit."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.receipt_files import read_records
from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.harness import apns_app_config
from tests.serve_process import finish, free_port, gone, kill_group, running_pids, spawn_serve

ROOT = Path(__file__).resolve().parents[1]
PUSHKEY = "ef" * 32
WAIT = 60.0  # seconds a test waits for a condition before failing
OPEN_NAME = re.compile(r"receipts-\d{8}T\d{6}Z-(\d+)-\d+\.jsonl\.open$")
PUBLISHED_NAME = re.compile(r"receipts-\d{8}T\d{6}Z-(\d+)-\d+\.jsonl$")


def _config(
    tmp_path: Path,
    apns: ApnsSimulator,
    *,
    workers: int,
    port: int,
    metrics_port: int | None = None,
    store_url: str | None = None,
) -> Path:
    app = apns_app_config(apns, tmp_path, topic="com.example.ios")
    server: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "workers": workers,
        "shutdown_timeout": 5.0,
    }
    if metrics_port is not None:
        server["metrics_port"] = metrics_port
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": server,
                "store": {"url": store_url or f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {
                    "directory": str(tmp_path / "receipts"),
                    "format": "jsonl",
                    "hmac_key": "k",
                },
                "plugins": {"enabled": ["matrix"], "matrix": {"apps": {"com.example.ios": app}}},
            }
        )
    )
    return config


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    env = {k: v for k, v in env.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


async def _spawn(config: Path, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await spawn_serve(config, env or _env())


async def _wait_for(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll another process's state (its files, its answers: no other signal exists)."""
    deadline = time.monotonic() + WAIT
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _notify(port: int, n: int) -> int:
    """One push, on a connection of its own: the kernel spreads new connections over the
    workers' sockets (SO_REUSEPORT)."""
    body = {
        "notification": {
            "event_id": f"$event{n}",
            "room_id": "!room:example.org",
            "counts": {"unread": 1},
            "devices": [{"app_id": "com.example.ios", "pushkey": PUSHKEY}],
        }
    }
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(f"http://127.0.0.1:{port}/_matrix/push/v1/notify", json=body) as response,
    ):
        return response.status


def _writers(directory: Path, name: re.Pattern[str]) -> set[int]:
    """The pids in the names of the receipt files of `directory` that match `name`."""
    if not directory.is_dir():
        return set()
    return {int(m.group(1)) for p in directory.iterdir() if (m := name.match(p.name))}


def _open_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if OPEN_NAME.match(p.name)]


async def _push_until_every_worker_wrote(port: int, receipts: Path, pids: list[int]) -> int:
    """Push, a connection each, until every worker has a receipt file open; how many."""
    sent = 0
    while _writers(receipts, OPEN_NAME) != set(pids):
        assert sent < 500, f"pushes reached workers {_writers(receipts, OPEN_NAME)} of {pids}"
        assert await _notify(port, sent) == 200
        sent += 1
    return sent


async def _scrape(metrics_port: int) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{metrics_port}/metrics") as response,
    ):
        assert response.status == 200
        return await response.text()


def _total(exposition: str, family: str) -> float:
    """The sum of a family's samples (every label set) in a Prometheus text exposition."""
    found = re.findall(rf"^{family}(?:\{{[^}}]*\}})? (\S+)$", exposition, re.MULTILINE)
    return sum(float(value) for value in found)


# --- every worker serves, /metrics adds them up, SIGTERM drains them all --------------------


async def test_every_worker_delivers_metrics_add_up_and_sigterm_drains_them_all(
    tmp_path: Path,
) -> None:
    """Two workers share the port: new connections reach both, each delivers to the
    provider and writes its own receipt file (its pid in the name). A scrape of /metrics,
    whichever worker answers it, counts the pushes of both. SIGTERM to the parent drains
    both: status 0, every receipt published, no `.open` file left behind."""
    receipts = tmp_path / "receipts"
    async with ApnsSimulator() as apns:
        port, metrics_port = free_port(), free_port()
        config = _config(tmp_path, apns, workers=2, port=port, metrics_port=metrics_port)
        proc = await _spawn(config)
        seen: list[str] = []
        try:
            pids = await running_pids(proc, seen, 2)
            sent = await _push_until_every_worker_wrote(port, receipts, pids)
            assert apns.request_count == sent

            async def counted_everywhere() -> bool:
                # Workers move their tallies into the shared files every second; the
                # scrape may be answered by either worker: both must see every push.
                scrapes = [await _scrape(metrics_port) for _ in range(4)]
                return all(_total(s, "pushgw_pushes_total") == sent for s in scrapes)

            await _wait_for(counted_everywhere, f"/metrics to count {sent} pushes")
            text = await _scrape(metrics_port)
            assert _total(text, "pushgw_provider_requests_total") == sent
            assert 'pid="' not in text  # every family one series per label set, not per worker
            proc.send_signal(signal.SIGTERM)
            status = await finish(proc, seen)
            assert all(gone(pid) for pid in pids)
        finally:
            kill_group(proc)
            await proc.wait()
    stderr = "".join(seen)
    assert status == 0, stderr
    assert "Traceback" not in stderr
    assert _writers(receipts, PUBLISHED_NAME) == set(pids)
    assert not _writers(receipts, OPEN_NAME), sorted(p.name for p in receipts.iterdir())
    assert len(read_records(receipts)) == sent


# --- a worker that dies: the gateway stops, with one line, the others drained ------------


async def test_a_worker_killed_outright_stops_the_gateway_with_one_line(tmp_path: Path) -> None:
    """`kill -9` of one worker (or the OOM killer): the gateway does not carry on at half
    capacity without a word. The parent names the worker in one line, stops the other
    gracefully (its receipts published) and exits 1, for the supervisor to restart the
    whole gateway. The dead worker's receipts written so far stay in its `.jsonl.open`
    file, which the next start publishes: none is lost."""
    receipts = tmp_path / "receipts"
    async with ApnsSimulator() as apns:
        port = free_port()
        proc = await _spawn(_config(tmp_path, apns, workers=2, port=port))
        seen: list[str] = []
        try:
            pids = await running_pids(proc, seen, 2)
            sent = await _push_until_every_worker_wrote(port, receipts, pids)

            async def all_written() -> bool:
                # SIGKILL loses what a writer still holds in memory (docs/cli.md): kill
                # once each worker has written what it accepted (every 0.25 s).
                try:
                    return sum(len(read_records(p)) for p in _open_files(receipts)) == sent
                except ValueError:  # read in the middle of a write: a line not all there yet
                    return False

            await _wait_for(all_written, f"{sent} receipts in the workers' open files")
            os.kill(pids[1], signal.SIGKILL)
            status = await finish(proc, seen)
            assert gone(pids[0])
        finally:
            kill_group(proc)
            await proc.wait()
    stderr = "".join(seen)
    assert status == 1, stderr
    # Workers listen in no set order: the killed one is worker 0 or 1.
    line = rf"pushgw: error: worker [01] \(pid {pids[1]}\) was killed by SIGKILL: stopping"
    line += r" the gateway\n"
    assert re.search(line, stderr), stderr
    assert "Traceback" not in stderr
    assert _writers(receipts, PUBLISHED_NAME) == {pids[0]}
    assert _writers(receipts, OPEN_NAME) == {pids[1]}
    left = sum(len(read_records(p)) for p in _open_files(receipts))
    assert len(read_records(receipts)) + left == sent


# --- PROMETHEUS_MULTIPROC_DIR inherited from the environment ---------------------------------


def _stale_metrics(directory: Path) -> None:
    """What a previous run (or another program) left in a multi-process directory."""
    script = (
        "from gateway.core.metrics import Metrics\nm = Metrics()\nm.receipts_written.inc(1000)\n"
    )
    env = _env(PROMETHEUS_MULTIPROC_DIR=str(directory))
    subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=True, timeout=60)


@pytest.mark.parametrize("directory", ["missing", "stale"])
async def test_an_inherited_multiprocess_directory_is_ignored(
    tmp_path: Path, directory: str
) -> None:
    """A `PROMETHEUS_MULTIPROC_DIR` left in the environment (a gunicorn habit) put the
    one-process gateway in prometheus-client's multi-process mode: a directory that does
    not exist was a traceback at start; one that does was never emptied, so a previous
    run's counts were added to this run's on /metrics (and the `process_*` metrics were
    gone). The gateway now keeps its own metrics and says, in one line, that the
    variable is ignored."""
    multiproc = tmp_path / "multiproc"
    if directory == "stale":
        multiproc.mkdir()
        _stale_metrics(multiproc)
    async with ApnsSimulator() as apns:
        port, metrics_port = free_port(), free_port()
        config = _config(tmp_path, apns, workers=1, port=port, metrics_port=metrics_port)
        proc = await _spawn(config, _env(PROMETHEUS_MULTIPROC_DIR=str(multiproc)))
        seen: list[str] = []
        try:
            await running_pids(proc, seen, 1)
            assert await _notify(port, 0) == 200
            text = await _scrape(metrics_port)
            proc.send_signal(signal.SIGTERM)
            status = await finish(proc, seen)
        finally:
            kill_group(proc)
            await proc.wait()
    stderr = "".join(seen)
    assert status == 0, stderr
    assert "Traceback" not in stderr
    assert "pushgw: warning: PROMETHEUS_MULTIPROC_DIR ignored" in stderr
    assert _total(text, "pushgw_pushes_total") == 1
    assert _total(text, "pushgw_receipts_written_total") < 1000
    assert "process_cpu_seconds_total" in text


# --- once per node: the invalid-token sweep -------------------------------------------------

SWEEP_LOG = (
    "CREATE TABLE review_sweeps (id serial PRIMARY KEY)",
    "CREATE FUNCTION review_log_sweep() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN INSERT INTO review_sweeps DEFAULT VALUES; RETURN NULL; END $$",
    # Per statement: a sweep that finds nothing to delete is counted too.
    "CREATE TRIGGER review_log_sweep BEFORE DELETE ON pushgw_invalid_tokens "
    "FOR EACH STATEMENT EXECUTE FUNCTION review_log_sweep()",
)


async def test_the_invalid_token_sweep_runs_once_per_node(
    tmp_path: Path, postgres_url: str
) -> None:
    """Every worker swept the invalid-token records at start and hourly: with
    `--workers 4`, four DELETEs over the same rows, competing for the same locks, where
    one does the job. The first worker alone sweeps now."""
    async with ApnsSimulator() as apns:
        port = free_port()
        config = _config(tmp_path, apns, workers=2, port=port, store_url=postgres_url)
        upgrade = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "db", "upgrade", "--config", str(config),
            cwd=ROOT, env=_env(), stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert await asyncio.wait_for(upgrade.wait(), WAIT) == 0
        engine = create_async_engine(postgres_url)
        try:
            async with engine.begin() as conn:
                for statement in SWEEP_LOG:
                    await conn.execute(text(statement))

            async def sweeps() -> int:
                async with engine.connect() as conn:
                    result = await conn.execute(text("SELECT count(*) FROM review_sweeps"))
                    return int(result.scalar_one())

            proc = await _spawn(config)
            seen: list[str] = []
            try:
                pids = await running_pids(proc, seen, 2)

                async def swept() -> bool:
                    return await sweeps() >= 1

                await _wait_for(swept, "the sweep at start")
                # Each worker has delivered: both cores (and, before, both sweepers) ran.
                await _push_until_every_worker_wrote(port, tmp_path / "receipts", pids)
                proc.send_signal(signal.SIGTERM)
                status = await finish(proc, seen)
            finally:
                kill_group(proc)
                await proc.wait()
            assert status == 0, "".join(seen)
            assert await sweeps() == 1
        finally:
            await engine.dispose()
