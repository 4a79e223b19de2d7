"""A `pushgw serve` subprocess: its stderr and its processes, for the tests that run it whole."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

# a port for the gateway under test, re-exported for the tests that run it
from gateway.testing.relay import free_port as free_port

ROOT = Path(__file__).resolve().parents[1]

# Seconds a test waits for a line or for the process to end before failing: bounded, as
# a process killed by the signal under test may leave workers holding its stderr.
WAIT = 120.0


async def spawn_serve(
    config: Path, env: dict[str, str], stderr: int = asyncio.subprocess.PIPE
) -> asyncio.subprocess.Process:
    """`pushgw serve --config CONFIG` in a session (process group) of its own: the
    test's signals reach it alone, and the whole group can be killed at the end."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(config),
        cwd=ROOT,
        env=env,
        stderr=stderr,
        start_new_session=True,
    )


async def read_until(proc: asyncio.subprocess.Process, seen: list[str], pattern: str) -> str:
    """Read stderr lines into `seen` until one matches `pattern`; that line."""
    assert proc.stderr is not None
    while line := (await asyncio.wait_for(proc.stderr.readline(), WAIT)).decode():
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"stderr ended before {pattern!r}: " + "".join(seen))


async def running_pids(
    proc: asyncio.subprocess.Process, seen: list[str], workers: int
) -> list[int]:
    """The pids of the processes serving, in the order they listen (`Running on` lines)."""
    pids = []
    for _ in range(workers):
        line = await read_until(proc, seen, r"Running on")
        match = re.search(r"pushgw (\d+) \(", line)
        assert match, line
        pids.append(int(match.group(1)))
    return pids


async def finish(proc: asyncio.subprocess.Process, seen: list[str]) -> int:
    """The rest of stderr into `seen`, and the exit status: an AssertionError, not a hung
    test, when the process (or a worker holding its stderr) does not end."""
    assert proc.stderr is not None
    try:
        seen.append((await asyncio.wait_for(proc.stderr.read(), WAIT)).decode())
        return await asyncio.wait_for(proc.wait(), WAIT)
    except TimeoutError:
        raise AssertionError("pushgw serve did not end: " + "".join(seen)) from None


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process group `spawn_serve` started: a failed test leaves no gateway
    or worker behind."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
