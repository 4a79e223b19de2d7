"""The `pushgw` command, run as operators run it: in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import SAMPLE_PLUGIN_DIR, install_plugin_dist, offline_apns_app

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PUSHGW, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def write_config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0 and result.stdout.startswith("pushgw ")


@pytest.mark.parametrize("args", [["spark", "list"], ["plugins"]])
def test_a_closed_stdout_ends_the_command_quietly_with_141(args: list[str]) -> None:
    """`pushgw spark list | head -1`: no BrokenPipeError traceback, the SIGPIPE status."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte: no race
    try:
        result = subprocess.run(
            [*PUSHGW, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


@pytest.mark.parametrize("args", [["spark", "list"], ["plugins"]])
def test_a_full_stdout_is_one_line_and_status_1(args: list[str]) -> None:
    """`pushgw plugins > /dev/full`: the error, not a traceback at the last flush."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [*PUSHGW, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert (result.returncode, result.stderr) == (
        1,
        "pushgw: error: cannot write to stdout: No space left on device\n",
    )


def test_plugins_lists_the_builtins() -> None:
    result = run("plugins", "--json")
    assert result.returncode == 0, result.stderr
    names = {p["name"]: p for p in json.loads(result.stdout)}
    assert {"matrix", "zulip", "marmot", "receipts-spark"} <= set(names)
    assert names["matrix"]["distribution"] == "pushgw"


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"delivery": {"max_retries": -1}})
    result = run("check-config", "--config", str(path))
    assert result.returncode == 2
    assert f"{path}: delivery.max_retries:" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = run("serve", "--config", str(tmp_path / "none.yaml"))
    assert result.returncode == 2 and "config file not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_masks_secrets(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"receipts": {"hmac_key": "very-secret-hmac"}})
    result = run("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    normalized = json.loads(result.stdout)
    assert normalized["receipts"]["hmac_key"] == "**********"
    assert "very-secret-hmac" not in result.stdout + result.stderr


def test_db_upgrade(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, {"store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"}}
    )
    result = run("db", "upgrade", "--config", str(path))
    assert result.returncode == 0, result.stderr
    db = tmp_path / "db.sqlite"
    assert result.stdout == f"database at head (sqlite): sqlite+aiosqlite:///{db}\n"


def test_db_upgrade_after_a_plugin_is_disabled(tmp_path: Path) -> None:
    """The disabled plugin's revision stays in the database; Alembic must still locate
    it (before: "Can't locate revision identified by 'sample_0001'", status 1)."""
    site = tmp_path / "site"
    install_plugin_dist(site, "sample")
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(SAMPLE_PLUGIN_DIR), os.getcwd()])}
    store = {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}", "auto_upgrade": False}
    enabled = write_config(tmp_path, {"store": store, "plugins": {"enabled": ["sample"]}})
    assert run("db", "upgrade", "--config", str(enabled), env=env).returncode == 0
    disabled = tmp_path / "disabled.yaml"
    disabled.write_text(yaml.safe_dump({"store": store, "plugins": {"enabled": []}}))
    result = run("db", "upgrade", "--config", str(disabled), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("database at head (sqlite)")


def test_a_plugin_whose_commands_hook_raises_leaves_the_other_commands(
    tmp_path: Path,
) -> None:
    """Every installed plugin adds its commands, enabled or not: one that raises there
    is a warning naming it, not a traceback from every `pushgw` command."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "pushgw_broken.py").write_text(
        "from gateway.api import hookimpl\n\n"
        "@hookimpl\n"
        "def pushgw_commands(subparsers):\n"
        "    raise RuntimeError('secret-looking detail')\n"
    )
    site = tmp_path / "site"
    install_plugin_dist(site, "broken")
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(package), os.getcwd()])}
    path = write_config(tmp_path, {"store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db'}"}})
    result = run("check-config", "--config", str(path), env=env)
    assert result.returncode == 0, result.stderr
    assert "plugin 'broken': its pushgw_commands hook raised RuntimeError" in result.stderr
    assert "Traceback" not in result.stderr
    assert "secret-looking detail" not in result.stderr
    assert "zulip" in run("--help", env=env).stdout  # the other plugins' commands stay


@pytest.mark.parametrize("define", ["def", "async def"])
def test_a_plugin_sub_command_that_raises_is_one_line_naming_the_plugin(
    tmp_path: Path, define: str
) -> None:
    """Named by the plugin and its command, the exception by its kind and place only."""
    site = tmp_path / "site"
    install_plugin_dist(site, "raiser")
    (site / "pushgw_raiser.py").write_text(
        "from gateway.api import hookimpl\n\n"
        f"{define} purge(args, command_context):\n"
        "    raise KeyError('tok-abcdef0123456789')\n\n"
        "@hookimpl\n"
        "def pushgw_commands(subparsers):\n"
        "    sub = subparsers.add_parser('raiser').add_subparsers(required=True)\n"
        "    sub.add_parser('purge').set_defaults(handler=purge)\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.getcwd()])}
    result = run("raiser", "purge", env=env)
    assert result.returncode == 1
    assert result.stderr == (
        "pushgw: error: plugin 'raiser': its command 'raiser' raised "
        f"KeyError at {site / 'pushgw_raiser.py'}:4\n"
    )


def test_tokens_retire_reaches_the_plugin_hook(tmp_path: Path) -> None:
    # the sample plugin as an installed distribution, in the subprocess too
    site = tmp_path / "site" / "pushgw_sample-1.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: pushgw-sample\nVersion: 1.0\n")
    (site / "entry_points.txt").write_text("[pushgw.plugins]\nsample = pushgw_sample\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site.parent), str(SAMPLE_PLUGIN_DIR), os.getcwd()])}
    db = tmp_path / "db.sqlite"
    app = offline_apns_app(tmp_path)
    path = write_config(
        tmp_path,
        {
            "store": {"url": f"sqlite+aiosqlite:///{db}"},
            "plugins": {"enabled": ["sample"], "sample": {"apps": {"ios": app}}},
        },
    )
    dead = tmp_path / "dead-tokens.jsonl"
    dead.write_text(
        json.dumps(
            {
                "plugin": "sample",
                "app_id": "ios",
                "provider": "apns",
                "token_hash": "ab" * 32,
                "reason": "Unregistered",
                "failures": 3,
                "last_seen": 1.0,
            }
        )
        + "\n"
        + json.dumps(
            {
                "plugin": "other",
                "app_id": "x",
                "provider": None,
                "token_hash": "cd" * 32,
                "reason": "permanent",
                "failures": 1,
                "last_seen": 1.0,
            }
        )
        + "\n"
    )
    result = run("tokens", "retire", str(dead), "--config", str(path), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"retired 1 token in sqlite+aiosqlite:///{db}; skipped 1 of plugins not enabled\n"
    )
    assert "pushgw: skipped 1 token of plugin other: not enabled in this configuration" in (
        result.stderr
    )
    import sqlite3

    rows = sqlite3.connect(db).execute("SELECT token_hash, reason FROM sample_invalid").fetchall()
    assert rows == [("ab" * 32, "Unregistered")]


def test_tokens_retire_rejects_a_malformed_file(tmp_path: Path) -> None:
    dead = tmp_path / "dead.jsonl"
    dead.write_text("{not json\n")
    result = run("tokens", "retire", str(dead))
    assert result.returncode == 2 and f"{dead}:1: not a dead-token record" in result.stderr
    assert "Traceback" not in result.stderr


def _wait_healthy(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)  # the server is a separate process: poll until it listens
    raise AssertionError("pushgw serve did not become healthy")


def _healthz_count(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    prefix = 'pushgw_http_requests_total{method="GET",route="/healthz"'
    line = next((li for li in text.splitlines() if li.startswith(prefix)), None)
    return float(line.rsplit(" ", 1)[1]) if line is not None else 0.0


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_answers_health_and_metrics(tmp_path: Path, workers: int) -> None:
    port = free_port()
    path = write_config(
        tmp_path,
        {
            "server": {"port": port},
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
            "receipts": {"directory": str(tmp_path / "receipts")},
        },
    )
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(path), "--workers", str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        for _ in range(10):
            urllib.request.urlopen(url + "/healthz", timeout=5).read()
        # Every worker counts into the same exposition: at least the 10 health checks.
        # Another worker's tallies reach it within a second (docs: metrics); the only
        # signal from another process is the exposition itself, so it is polled.
        deadline = time.monotonic() + 10
        while (counted := _healthz_count(url)) < 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert counted >= 10
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0
    # server.event_loop: auto runs every worker on uvloop where it is installed
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    started = [line for line in stderr.splitlines() if "======== Running on" in line]
    assert started and all(f"({loop} loop)" in line for line in started), stderr


def test_serve_runs_on_the_configured_loop(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(
        tmp_path,
        {
            "server": {"port": port, "event_loop": "asyncio"},
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        },
    )
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "(asyncio loop): ======== Running on" in stderr, stderr


@pytest.mark.parametrize("auto_upgrade", [True, False])
def test_a_plugin_command_on_an_unreachable_database_is_one_line(
    tmp_path: Path, auto_upgrade: bool
) -> None:
    """`CommandContext.open_store` opens the store as the core's commands do."""
    with socket.socket() as refusing:  # bound, never listening: connections are refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        url = f"postgresql+asyncpg://u:S3cretPw@127.0.0.1:{port}/x"
        path = write_config(
            tmp_path,
            {
                "store": {"url": url, "auto_upgrade": auto_upgrade},
                "plugins": {"enabled": ["zulip"]},
            },
        )
        result = run("--config", str(path), "zulip", "servers")
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"pushgw: error: database postgresql+asyncpg://u:***@127.0.0.1:{port}/x: "
        "ConnectionRefusedError: "
    )
    assert result.stderr.count("\n") == 1 and "S3cretPw" not in result.stderr
    assert result.stdout == ""


def test_a_plugin_command_on_an_unusable_sqlite_path_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")  # a file where the database's directory should be
    db = tmp_path / "afile" / "pushgw.db"
    path = write_config(
        tmp_path,
        {"store": {"url": f"sqlite+aiosqlite:///{db}"}, "plugins": {"enabled": ["zulip"]}},
    )
    result = run("--config", str(path), "zulip", "gc")
    assert result.returncode == 1
    assert result.stderr.startswith(f"pushgw: error: database sqlite+aiosqlite:///{db}: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
