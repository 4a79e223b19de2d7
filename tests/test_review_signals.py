"""What each signal does to `pushgw serve`, run as a real process against the APNs
simulator: found by review, each with a failing test first. No sleeps stand in for
synchronisation: the tests wait on the gateway's own lines, its exit, or /proc."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.receipt_files import read_records
from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.harness import apns_app_config
from tests.serve_process import (
    finish,
    free_port,
    gone,
    kill_group,
    read_until,
    running_pids,
    spawn_serve,
)

ROOT = Path(__file__).resolve().parents[1]
PUSHKEY = "cd" * 32


def _config(tmp_path: Path, apns: ApnsSimulator, port: int, workers: int) -> Path:
    app = apns_app_config(apns, tmp_path, topic="com.example.ios")
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {
                    "host": "127.0.0.1",
                    "port": port,
                    "workers": workers,
                    "shutdown_timeout": 5.0,
                },
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {"directory": str(tmp_path / "receipts"), "hmac_key": "k"},
                "plugins": {"enabled": ["matrix"], "matrix": {"apps": {"com.example.ios": app}}},
            }
        )
    )
    return config


async def _spawn(config: Path, stderr: int) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PUSHGW_CONFIG", None)
    return await spawn_serve(config, env, stderr)


async def _notify(port: int, n: int) -> int:
    body = {
        "notification": {
            "event_id": f"$event{n}",
            "room_id": "!room:example.org",
            "counts": {"unread": 1},
            "devices": [{"app_id": "com.example.ios", "pushkey": PUSHKEY}],
        }
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/_matrix/push/v1/notify", json=body) as response,
    ):
        return response.status


async def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll /proc (another process's state has no other signal) until `condition`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _listening(port: int) -> bool:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
            return True
    return False


def _receipts(tmp_path: Path) -> list[dict[str, Any]]:
    return read_records(tmp_path / "receipts")


# --- SIGHUP, SIGUSR1, SIGUSR2: logged and ignored ------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
async def test_sighup_and_sigusr_are_ignored_with_a_line_and_nothing_is_lost(
    tmp_path: Path, workers: int
) -> None:
    """logrotate's postrotate and `systemctl reload` send SIGHUP; some tools SIGUSR1 or
    SIGUSR2. Python's default for each ended the gateway on the spot, without a drain:
    the receipts of pushes it had accepted, still in memory, were lost, and with several
    workers the parent died and left them running on the port. Now each is logged and
    ignored, by the parent and by every worker; the gateway serves on, and the SIGTERM
    that follows stops it gracefully with every receipt kept."""
    async with ApnsSimulator() as apns:
        port = free_port()
        proc = await _spawn(_config(tmp_path, apns, port, workers), asyncio.subprocess.PIPE)
        seen: list[str] = []
        try:
            pids = await running_pids(proc, seen, workers)
            assert await _notify(port, 0) == 200
            for name in ("SIGHUP", "SIGUSR1", "SIGUSR2"):
                targets = [proc.pid] if workers == 1 else [proc.pid, *pids]
                for pid in targets:
                    os.kill(pid, getattr(signal, name))
                    await read_until(proc, seen, rf"{name} ignored")
            assert await _notify(port, 1) == 200
            proc.send_signal(signal.SIGTERM)
            status = await finish(proc, seen)
        finally:
            kill_group(proc)
            await proc.wait()
    stderr = "".join(seen)
    assert status == 0, stderr
    assert "Traceback" not in stderr
    assert len(_receipts(tmp_path)) == 2, stderr


# --- SIGQUIT: a graceful stop, as SIGTERM -------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigquit_stops_the_gateway_gracefully(tmp_path: Path, workers: int) -> None:
    """SIGQUIT (a terminal's Ctrl-\\, Docker images whose STOPSIGNAL is SIGQUIT) dumped
    core by default: no drain, the accepted pushes' receipts lost, and with workers the
    parent gone and the workers left serving. It now stops the gateway as SIGTERM does."""
    async with ApnsSimulator() as apns:
        port = free_port()
        proc = await _spawn(_config(tmp_path, apns, port, workers), asyncio.subprocess.PIPE)
        seen: list[str] = []
        try:
            pids = await running_pids(proc, seen, workers)
            assert await _notify(port, 0) == 200
            proc.send_signal(signal.SIGQUIT)
            status = await finish(proc, seen)
            await _wait_for(lambda: all(gone(pid) for pid in pids), "the workers to exit")
        finally:
            kill_group(proc)
            await proc.wait()
    stderr = "".join(seen)
    assert status == 0, stderr
    assert "Traceback" not in stderr
    assert len(_receipts(tmp_path)) == 1, stderr


# --- the parent killed outright: no orphans ------------------------------------------------


async def test_workers_stop_gracefully_when_their_parent_is_killed(tmp_path: Path) -> None:
    """The parent of `--workers N` killed by SIGKILL (the OOM killer, `kill -9`, a
    supervisor that kills the main process only): its workers went on serving, orphans
    holding the port, so the restarted gateway could not listen ("address already in
    use") and their receipts waited in memory. Each worker now stops gracefully when its
    parent dies: it exits and publishes the receipts it held."""
    async with ApnsSimulator() as apns:
        port = free_port()
        proc = await _spawn(_config(tmp_path, apns, port, 2), asyncio.subprocess.PIPE)
        seen: list[str] = []
        try:
            pids = await running_pids(proc, seen, 2)
            assert await _notify(port, 0) == 200
            proc.send_signal(signal.SIGKILL)
            await _wait_for(lambda: gone(proc.pid), "the parent to die")
            await _wait_for(lambda: all(gone(pid) for pid in pids), "the orphaned workers to exit")
            assert not _listening(port)
        finally:
            kill_group(proc)
            await proc.wait()
    assert len(_receipts(tmp_path)) == 1, "".join(seen)


# --- stderr a closed pipe ------------------------------------------------------------------


async def test_a_closed_stderr_does_not_stop_the_gateway(tmp_path: Path) -> None:
    """`pushgw serve 2>&1 | head -1` whose reader has gone, or a log collector restarted
    before the gateway said `Running on`: writing that line raised BrokenPipeError out of
    aiohttp's start-up, and the gateway that had just started listening stopped (status
    141). Its log lines have nowhere to go, but the gateway serves on, and stops as it is
    told to with its receipts kept."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the gateway writes a word
    async with ApnsSimulator() as apns:
        port = free_port()
        try:
            proc = await _spawn(_config(tmp_path, apns, port, 1), write_end)
        finally:
            os.close(write_end)
        try:
            await _wait_for(lambda: _listening(port) or proc.returncode is not None, "listening")
            assert await _notify(port, 0) == 200
            proc.send_signal(signal.SIGTERM)
            status = await asyncio.wait_for(proc.wait(), 120)
        finally:
            kill_group(proc)
            await proc.wait()
    assert status == 0
    assert len(_receipts(tmp_path)) == 1
