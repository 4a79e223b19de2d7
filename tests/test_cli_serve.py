"""`pushgw serve` refuses what cannot work in one line, before anything starts."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway import serve
from gateway.context import WORKER_ENV
from tests.conftest import install_plugin_dist, process_gone

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PUSHGW, *args], capture_output=True, text=True, timeout=120)


def write_config(tmp_path: Path, **server: object) -> Path:
    path = tmp_path / "pushgw.yaml"
    data = {
        "server": server,
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line_before_anything_starts(
    tmp_path: Path, busy_port: int, workers: str
) -> None:
    path = write_config(tmp_path)
    result = run("serve", "--config", str(path), "--port", str(busy_port), "--workers", workers)
    assert result.returncode == 2
    assert result.stderr == (
        f"pushgw: error: cannot listen on 127.0.0.1:{busy_port}: address already in use\n"
    )
    assert not (tmp_path / "db.sqlite").exists()  # bound before the migrations


def test_the_metrics_port_in_use_is_one_line(tmp_path: Path, busy_port: int) -> None:
    path = write_config(tmp_path, metrics_port=busy_port)
    result = run("serve", "--config", str(path), "--port", "0")
    assert result.returncode == 2
    assert result.stderr == (
        f"pushgw: error: cannot listen on 127.0.0.1:{busy_port} (/metrics): "
        "address already in use\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "argument --port: must be 0 to 65535 (0: any free port), not 70000"),
        (["--port", "-1"], "argument --port: must be 0 to 65535 (0: any free port), not -1"),
        (["--port", "http"], "argument --port: not a port number: 'http'"),
        (["--workers", "0"], "argument --workers: must be at least 1, not 0"),
        (["--workers", "-1"], "argument --workers: must be at least 1, not -1"),
    ],
)
def test_bad_port_and_workers_are_usage_errors(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = run("serve", "--config", str(write_config(tmp_path)), *args)
    assert result.returncode == 2
    assert result.stderr.rstrip().endswith(f"pushgw serve: error: {message}")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "db.sqlite").exists()


def test_any_free_port_needs_one_worker(tmp_path: Path) -> None:
    result = run("serve", "--config", str(write_config(tmp_path)), "--port", "0", "--workers", "2")
    assert result.returncode == 2
    assert result.stderr == (
        "pushgw: error: port 0 (any free port) would give each worker its own port: give a port\n"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_unreachable_database_is_one_line(tmp_path: Path, workers: str) -> None:
    listen_on = free_port()
    with socket.socket() as refusing:  # bound, never listening: connections are refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        path = tmp_path / "pushgw.yaml"
        url = f"postgresql+asyncpg://u:S3cretPw@127.0.0.1:{port}/x"
        receipts = {"directory": str(tmp_path / "receipts")}  # not var/ in the checkout
        path.write_text(yaml.safe_dump({"store": {"url": url}, "receipts": receipts}))
        result = run("serve", "--config", str(path), "--port", str(listen_on), "--workers", workers)
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"pushgw: error: database postgresql+asyncpg://u:***@127.0.0.1:{port}/x: "
        "ConnectionRefusedError: "
    )
    assert result.stderr.count("\n") == 1 and "S3cretPw" not in result.stderr


def test_port_0_serves_on_a_free_port(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(write_config(tmp_path)), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the server's own announcement is the signal
            if match := re.search(r"Running on http://127\.0\.0\.1:(\d+)", line):
                break
        else:
            raise AssertionError("pushgw serve ended without listening")
        port = int(match.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
            assert response.status == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_a_worker_that_cannot_listen_says_so_in_one_line(
    busy_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent checked the port; another process took it before this worker bound it.
    monkeypatch.setenv(WORKER_ENV, "1")
    with pytest.raises(SystemExit) as exit:
        serve._run_worker(None, {}, "127.0.0.1", busy_port, 1)
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        f"pushgw: error: cannot listen on 127.0.0.1:{busy_port}: address already in use\n"
    )


# --- a worker that ends while the gateway runs ends the gateway ----------------------

# A plugin whose service cannot start in worker 1 (a real start-up failure, as a relay
# that cannot be reached would be). Worker 1 fails only once worker 0's service has
# started (a FIFO hand-over, no sleeps): worker 0 is then up, and must be stopped.
HANDSHAKE_PLUGIN = """
import os
from pathlib import Path

from gateway.api import hookimpl


class Handshake:
    name = "handshake"

    def __init__(self):
        self.running = False

    async def start(self):
        fifo = Path(os.environ["HANDSHAKE_FIFO"])
        worker = os.environ["PUSHGW_WORKER"]
        fifo.with_name(f"worker-{worker}.pid").write_text(str(os.getpid()))
        if worker == "0":
            with fifo.open("w") as pipe:  # blocks until worker 1 opens it
                pipe.write("started")
            self.running = True
            return
        with fifo.open() as pipe:  # until worker 0 has started and closed it
            pipe.read()
        raise RuntimeError("handshake: cannot start in this worker")

    async def stop(self):
        self.running = False

    def ready(self):
        return self.running


@hookimpl
def pushgw_services(context):
    return [Handshake()]
"""


def test_a_worker_failing_at_start_up_stops_the_gateway(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_plugin_dist(site, "handshake")
    (site / "pushgw_handshake.py").write_text(HANDSHAKE_PLUGIN)
    fifo = tmp_path / "handshake.fifo"
    os.mkfifo(fifo)
    path = tmp_path / "pushgw.yaml"
    config = {
        "server": {"port": free_port(), "workers": 2, "shutdown_timeout": 1},
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
        "plugins": {"enabled": ["handshake"]},
    }
    path.write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.getcwd()]),
        "HANDSHAKE_FIFO": str(fifo),
    }
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(path)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: cleaned up below whatever happens
    )
    try:
        _, stderr = proc.communicate(timeout=60)  # without the fix: worker 0 serves on
        pids = {n: int((tmp_path / f"worker-{n}.pid").read_text()) for n in (0, 1)}
        left = [pid for pid in pids.values() if not process_gone(pid)]  # before the clean-up below
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 1, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("pushgw: error:")]
    assert lines == [
        f"pushgw: error: worker 1 (pid {pids[1]}) exited with status 1: stopping the gateway"
    ]
    assert "RuntimeError: handshake: cannot start in this worker" in stderr  # worker 1's own
    assert left == []  # worker 0 was stopped, and both were reaped by the parent


def _exit_with(code: int, go: Any) -> None:
    go.wait()
    if code < 0:
        os.kill(os.getpid(), -code)  # as a worker killed by that signal
    sys.exit(code)


def _ignore_sigterm(ready: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        signal.pause()


def test_a_worker_deaf_to_sigterm_is_killed_after_the_grace_period(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    procs = [
        ctx.Process(target=_ignore_sigterm, args=(ready,)),
        ctx.Process(target=_exit_with, args=(3, ready)),
    ]
    for proc in procs:
        proc.start()
    try:
        status = serve._supervise(procs, lambda: False, grace=0.5)
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    assert status == 3
    assert [proc.exitcode for proc in procs] == [-signal.SIGKILL, 3]
    assert capsys.readouterr().err == (
        f"pushgw: error: worker 1 (pid {procs[1].pid}) exited with status 3: stopping the gateway\n"
    )


@pytest.mark.parametrize(
    ("code", "status"), [(0, 0), (-signal.SIGTERM, 0), (-signal.SIGKILL, 1), (2, 2)]
)
def test_workers_ending_after_a_stop_signal_give_their_status(code: int, status: int) -> None:
    """SIGTERM or SIGINT came: each worker's status counts, a clean stop is 0."""
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    go.set()
    procs = [
        ctx.Process(target=_exit_with, args=(0, go)),
        ctx.Process(target=_exit_with, args=(code, go)),
    ]
    for proc in procs:
        proc.start()
    try:
        # grace bounds the wait from the start (stopping): longer than a spawn takes
        assert serve._supervise(procs, lambda: True, grace=60) == status
    finally:
        for proc in procs:
            proc.join()


# --- mistakes found before anything starts --------------------------------------------


@pytest.mark.parametrize("host", ["exa mple..com", "a" * 70 + ".example.com"])
def test_a_host_that_is_no_host_name_is_one_line(tmp_path: Path, host: str) -> None:
    path = write_config(tmp_path)
    port = free_port()
    result = run("serve", "--config", str(path), "--host", host, "--port", str(port))
    assert result.returncode == 2, result.stderr
    # The reason in parentheses is the IDNA codec's: `label empty or too long` in 3.11.
    prefix = f"pushgw: error: cannot listen on {host}:{port}: not a valid host name ("
    assert result.stderr.startswith(prefix)
    assert result.stderr.endswith(")\n") and result.stderr.count("\n") == 1
    assert not (tmp_path / "db.sqlite").exists()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_metrics_port_must_differ_from_the_port(tmp_path: Path, workers: str) -> None:
    port = free_port()
    path = write_config(tmp_path, port=port, metrics_port=port)
    result = run("serve", "--config", str(path), "--workers", workers)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"pushgw: error: server.metrics_port must differ from server.port ({port})\n"
    )
    assert not (tmp_path / "db.sqlite").exists()  # found before the migrations


def test_the_metrics_port_must_differ_from_the_port_given(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, metrics_port=port)
    result = run("serve", "--config", str(path), "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"pushgw: error: server.metrics_port must differ from --port ({port})\n"


def test_a_metrics_port_of_0_is_one_line(tmp_path: Path) -> None:
    """Any free port for /metrics would be a port no one is told (nor the same in each
    worker): out of 1 to 65535, server.metrics_port is a config error."""
    path = write_config(tmp_path, metrics_port=0)
    result = run("serve", "--config", str(path), "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"pushgw: config error: {path}: server.metrics_port: "
        "Input should be greater than or equal to 1\n"
    )
    assert not (tmp_path / "db.sqlite").exists()


def test_the_metrics_port_is_held_during_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process cannot take the metrics port while the database is checked and the
    application starts: the port is held from the check until the metrics site listens."""
    metrics_port = free_port()
    path = write_config(tmp_path, metrics_port=metrics_port)
    taken: list[bool] = []

    def another_process_binds(loaded: Any) -> None:
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", metrics_port))
                other.listen()
            except OSError:
                taken.append(False)
            else:
                taken.append(True)

    monkeypatch.setattr(serve, "_prepare_database", another_process_binds)
    monkeypatch.setattr(serve, "_run_loaded", lambda *args, **kwargs: None)
    assert serve.serve(config=str(path), data=None, host=None, port=0, workers=1) == 0
    assert taken == [False]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_metrics_are_served_on_their_own_port(tmp_path: Path, workers: str) -> None:
    port, metrics_port = free_port(), free_port()
    path = write_config(tmp_path, port=port, metrics_port=metrics_port, shutdown_timeout=1)
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(path), "--workers", workers],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        running = 0
        seen = []
        for line in proc.stderr:  # each worker announces itself once it listens
            seen.append(line)
            running += "Running on" in line
            if running == int(workers):
                break
        else:
            raise AssertionError("pushgw serve ended without listening: " + "".join(seen))
        for _ in range(4):  # any worker may answer; none hangs on a held port
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr


def test_a_worker_that_cannot_listen_on_the_metrics_port_says_so_in_one_line(
    tmp_path: Path,
    busy_port: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The parent checked the metrics port; another process took it before this worker.
    data = yaml.safe_load(write_config(tmp_path, metrics_port=busy_port).read_text())
    monkeypatch.setenv(WORKER_ENV, "1")
    with pytest.raises(SystemExit) as exit:
        serve._run_worker(None, data, "127.0.0.1", free_port(), 1)
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        f"pushgw: error: cannot listen on 127.0.0.1:{busy_port} (/metrics): "
        "address already in use\n"
    )


# --- workers: the configuration as the parent loaded it, without a second migration ----


def test_a_whole_section_variable_works_with_workers(tmp_path: Path) -> None:
    port = free_port()
    url = f"sqlite+aiosqlite:///{tmp_path / 'w.db'}"
    env = {
        **os.environ,
        "PUSHGW__STORE": json.dumps({"url": url}),
        "PUSHGW__RECEIPTS": json.dumps({"directory": str(tmp_path / "receipts")}),
        "PUSHGW__SERVER__SHUTDOWN_TIMEOUT": "1",
    }
    env.pop("PUSHGW_CONFIG", None)
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--workers", "2", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    seen = []
    try:
        assert proc.stderr is not None
        running = 0
        for line in proc.stderr:
            seen.append(line)
            running += "Running on" in line
            if running == 2:
                break
        else:
            raise AssertionError("pushgw serve ended without listening: " + "".join(seen))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
            assert response.status == 200
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, "".join(seen) + stderr
    assert "Traceback" not in "".join(seen) + stderr
    assert (tmp_path / "w.db").exists()  # migrated by the parent, from the variable


def test_workers_do_not_migrate_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent migrated once: each worker runs with store.auto_upgrade off."""
    ran: list[Any] = []
    monkeypatch.setenv(WORKER_ENV, "0")
    monkeypatch.setattr(serve, "_run_loaded", lambda loaded, *args, **kwargs: ran.append(loaded))
    serve._run_worker(None, {}, "127.0.0.1", free_port(), 0, migrated=True)
    (loaded,) = ran
    assert loaded.settings.store.auto_upgrade is False
    assert loaded.runtime.settings.store.auto_upgrade is False  # what plugins see


def test_a_worker_with_a_config_error_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WORKER_ENV, "1")
    with pytest.raises(SystemExit) as exit:
        serve._run_worker(None, {"server": {"nope": 1}}, "127.0.0.1", free_port(), 1)
    assert exit.value.code == 2
    assert capsys.readouterr().err == ("pushgw: config error: server.nope: unknown key\n")


def test_a_worker_with_a_database_error_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway import app
    from gateway.cli import DatabaseError

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise DatabaseError("database sqlite+aiosqlite:///x.db: unable to open database file")

    monkeypatch.setenv(WORKER_ENV, "1")
    monkeypatch.setattr(app, "load_gateway", unreachable)
    with pytest.raises(SystemExit) as exit:
        serve._run_worker(None, {}, "127.0.0.1", free_port(), 1)
    assert exit.value.code == 1
    assert capsys.readouterr().err == (
        "pushgw: error: database sqlite+aiosqlite:///x.db: unable to open database file\n"
    )


# --- --with-simulators DIR ----------------------------------------------------------


def test_simulators_into_a_file_is_one_line(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    state = tmp_path / "some.yaml"
    state.write_text("")
    result = run("serve", "--config", str(path), "--port", "0", "--with-simulators", str(state))
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"pushgw: error: --with-simulators {state}: not a directory\n"
    assert not (tmp_path / "db.sqlite").exists()


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("some.yaml/simulators", "not a directory"),
        ("/proc/nope", "no such file or directory"),
    ],
)
def test_simulators_into_a_directory_that_cannot_be_made_is_one_line(
    tmp_path: Path, state: str, reason: str
) -> None:
    path = write_config(tmp_path)
    (tmp_path / "some.yaml").write_text("")
    state = str(tmp_path / state)  # an absolute path stays as it is
    result = run("serve", "--config", str(path), "--port", "0", "--with-simulators", state)
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr == f"pushgw: error: --with-simulators {state}: cannot create it: {reason}\n"
    )
    assert not (tmp_path / "db.sqlite").exists()


def test_simulators_into_a_directory_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    state = Path("/sys")  # no one may create files there, root included
    if not state.is_dir():
        pytest.skip("no /sys here")
    path = write_config(tmp_path)
    result = run("serve", "--config", str(path), "--port", "0", "--with-simulators", str(state))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"pushgw: error: --with-simulators {state}: cannot write into it: "
    )
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "db.sqlite").exists()
