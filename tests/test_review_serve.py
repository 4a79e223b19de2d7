"""`pushgw serve --workers N` and stop signals: found by review, each with a failing test first."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import yaml

from tests.conftest import install_plugin_dist, process_gone

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll files under /proc (another process's state has no other signal)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _listening_inodes(port: int) -> set[str]:
    """The sockets listening on 127.0.0.1:`port`, as `socket:[inode]`."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
            found.add(f"socket:[{fields[9]}]")
    return found


def _open_sockets(pid: int) -> set[str]:
    found = set()
    with contextlib.suppress(FileNotFoundError):  # the process has exited
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


def _start_serve(
    tmp_path: Path, site: Path, plugin: str, server: Mapping[str, object]
) -> subprocess.Popen[str]:
    path = tmp_path / "pushgw.yaml"
    config = {
        "server": dict(server),
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
        "plugins": {"enabled": [plugin]},
    }
    path.write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.getcwd()]),
        "REVIEW_DIR": str(tmp_path),
    }
    env.pop("PUSHGW_CONFIG", None)
    return subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(path)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: cleaned up whatever happens
    )


def _running_pids(proc: subprocess.Popen[str], workers: int) -> list[int]:
    """The workers' pids, from their `Running on` lines (each says so once it listens)."""
    assert proc.stderr is not None
    pids: list[int] = []
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if match := re.search(r"pushgw (\d+) \(.*Running on", line):
            pids.append(int(match.group(1)))
            if len(pids) == workers:
                return pids
    raise AssertionError("pushgw serve ended without listening: " + "".join(seen))


def _end(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# --- a second stop signal during the drain ---------------------------------------------

# A route whose request stays in flight until the test lets it finish (FIFOs, no sleeps).
SLOW_PLUGIN = """
import asyncio
import os
from pathlib import Path

from aiohttp import web

from gateway.api import hookimpl


async def slow(request):
    where = Path(os.environ["REVIEW_DIR"])
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, (where / "started.fifo").write_text, str(os.getpid()))
    await loop.run_in_executor(None, (where / "release.fifo").read_text)
    return web.Response(text="finished")


@hookimpl
def pushgw_routes(context, router):
    router.add_get("/slow", slow)
"""


def _release(fifo: Path) -> None:
    """Write into `fifo` once the request reads it (its reader opens it in a thread)."""
    fds: list[int] = []

    def opened() -> bool:
        try:
            fds.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:  # ENXIO: no reader yet
            assert exc.errno == errno.ENXIO
            return False
        return True

    _wait_for(opened, f"a reader of {fifo.name}")
    os.write(fds[0], b"go")
    os.close(fds[0])


def test_a_second_stop_signal_does_not_cut_the_drain_short(tmp_path: Path) -> None:
    """systemd (KillMode=control-group) sends SIGTERM to every process of the service, and
    a terminal's Ctrl-C SIGINT to every process of its group: each worker gets the signal
    itself and again from the parent. The second one must not end the graceful shutdown
    that the first began: the request in flight finishes, the worker exits 0."""
    site = tmp_path / "site"
    install_plugin_dist(site, "slow")
    (site / "pushgw_slow.py").write_text(SLOW_PLUGIN)
    for name in ("started.fifo", "release.fifo"):
        os.mkfifo(tmp_path / name)
    port = free_port()
    server = {"port": port, "workers": 2, "shutdown_timeout": 120}
    proc = _start_serve(tmp_path, site, "slow", server)
    answers: list[object] = []

    def get() -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/slow", timeout=120) as resp:
                answers.append((resp.status, resp.read()))
        except Exception as exc:  # the answer the bug gives: the connection closed
            answers.append(repr(exc))

    client = threading.Thread(target=get)
    try:
        _running_pids(proc, 2)
        client.start()
        worker = int((tmp_path / "started.fifo").read_text())  # the request is in flight
        listening = _listening_inodes(port) & _open_sockets(worker)
        assert listening
        os.kill(proc.pid, signal.SIGTERM)  # forwarded: the worker starts its drain ...
        _wait_for(lambda: not listening & _open_sockets(worker), "the worker to stop listening")
        os.kill(worker, signal.SIGTERM)  # ... and its own SIGTERM comes during it
        _release(tmp_path / "release.fifo")
        client.join(timeout=120)
        _, stderr = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert answers == [(200, b"finished")], stderr
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr


# --- a stop signal while the workers start ---------------------------------------------

# A plugin whose loading, in a worker, waits until the worker is told to stop: the worker
# is then starting (its configuration loads), before the application handles signals.
STARTING_PLUGIN = """
import os
from pathlib import Path

worker = os.environ.get("PUSHGW_WORKER")
if worker is not None:  # the parent loads plugins too: only the workers wait
    where = Path(os.environ["REVIEW_DIR"])
    (where / f"starting-{worker}.fifo").write_text(str(os.getpid()))
    (where / "never.fifo").read_text()  # no writer ever: until a signal ends the wait
"""


def test_sigint_while_the_workers_start_is_a_clean_stop(tmp_path: Path) -> None:
    """docs/cli.md: the parent exits with 0 when every worker exited 0 or was ended by
    the stop signal before it had started. A SIGINT (forwarded, or a terminal's Ctrl-C)
    that comes while a worker starts ends it as SIGTERM does: no traceback, status 0."""
    site = tmp_path / "site"
    install_plugin_dist(site, "starting")
    (site / "pushgw_starting.py").write_text(STARTING_PLUGIN)
    for name in ("starting-0.fifo", "starting-1.fifo", "never.fifo"):
        os.mkfifo(tmp_path / name)
    server = {"port": free_port(), "workers": 2, "shutdown_timeout": 1}
    proc = _start_serve(tmp_path, site, "starting", server)
    try:
        for worker in (0, 1):  # each is loading its configuration now
            int((tmp_path / f"starting-{worker}.fifo").read_text())
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert "Traceback" not in stderr, stderr
    assert proc.returncode == 0, stderr


# --- --with-simulators: the simulators end with `serve`, whenever it is stopped -------------


def _ports_free(*ports: int) -> bool:
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def test_sigterm_during_start_up_stops_the_simulators(tmp_path: Path) -> None:
    """SIGTERM while `serve --with-simulators` waits for its database: the simulators
    (`python -m gateway.testing.standalone`) end with it, not left running on their ports,
    where the next `serve --with-simulators` could not start them."""
    if not _ports_free(2197, 4080):  # the simulators' fixed ports
        pytest.skip("the simulators' ports are in use")
    state = tmp_path / "simulators"
    with socket.socket() as silent:  # a database that accepts and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        path = tmp_path / "pushgw.yaml"
        url = f"postgresql+asyncpg://u@127.0.0.1:{silent.getsockname()[1]}/x"
        path.write_text(yaml.safe_dump({"store": {"url": url}}))
        err = tmp_path / "stderr"
        with err.open("w") as stderr_file:  # not a pipe: the simulators would hold it open
            args = ["serve", "--config", str(path), "--port", "0", "--with-simulators", str(state)]
            proc = subprocess.Popen(
                [*PUSHGW, *args],
                stdout=subprocess.DEVNULL,
                stderr=stderr_file,
                cwd=tmp_path,  # its default receipts directory (var/receipts) lands here
                start_new_session=True,  # the simulators too: cleaned up below whatever happens
            )
        try:
            connection, _ = silent.accept()  # the simulators are up; the database is asked
            with connection:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)
            ready_left = (state / "ready.json").exists()  # the simulators remove it at exit
            simulators_left = [
                pid
                for pid in os.listdir("/proc")
                if pid.isdigit()
                and str(state).encode() in _cmdline(int(pid))
                and not _zombie(int(pid))
            ]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = err.read_text()
    assert simulators_left == [], stderr
    assert not ready_left
    assert "Traceback" not in stderr


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# --- a worker that never stops after the stop signal -----------------------------------

# A service whose stop() never returns in worker 1 (a relay close that is never answered,
# say); worker 0 stops as usual. Files tell the test each worker's pid and that worker 1
# reached stop().
HANGING_PLUGIN = """
import asyncio
import os
from pathlib import Path

from gateway.api import hookimpl


class Hanging:
    name = "hanging"

    async def start(self):
        (self.where / f"worker-{self.worker}.pid").write_text(str(os.getpid()))

    async def stop(self):
        if self.worker == "1":
            (self.where / "stopping-1").write_text(str(os.getpid()))
            await asyncio.get_running_loop().create_future()  # never done

    def ready(self):
        return True

    @property
    def where(self):
        return Path(os.environ["REVIEW_DIR"])

    @property
    def worker(self):
        return os.environ["PUSHGW_WORKER"]


@hookimpl
def pushgw_services(context):
    return [Hanging()]
"""


def test_a_worker_that_does_not_stop_after_sigterm_is_killed_after_the_grace_period(
    tmp_path: Path,
) -> None:
    """After SIGTERM the parent waited for the workers without a deadline: a worker whose
    shutdown hung (a plugin's stop() that never returns) kept `serve` running forever.
    It is killed after the grace period (twice shutdown_timeout + 10 s), named in one
    line, and `serve` exits non-zero; the worker that stopped in time is not named."""
    site = tmp_path / "site"
    install_plugin_dist(site, "hanging")
    (site / "pushgw_hanging.py").write_text(HANGING_PLUGIN)
    server = {"port": free_port(), "workers": 2, "shutdown_timeout": 0}
    proc = _start_serve(tmp_path, site, "hanging", server)
    try:
        _running_pids(proc, 2)
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)  # without the fix: never returns
        pids = {n: int((tmp_path / f"worker-{n}.pid").read_text()) for n in (0, 1)}
        left = [pid for pid in pids.values() if not process_gone(pid)]  # before the clean-up below
    finally:
        _end(proc)
    assert proc.returncode == 1, stderr
    assert (tmp_path / "stopping-1").read_text() == str(pids[1])  # it hung in stop()
    lines = [line for line in stderr.splitlines() if line.startswith("pushgw: error:")]
    assert lines == [
        f"pushgw: error: worker 1 (pid {pids[1]}) did not stop within 10 seconds "
        "of the stop signal: killed it (SIGKILL)"
    ]
    assert left == []  # killed, and reaped by the parent
    assert "Traceback" not in stderr
