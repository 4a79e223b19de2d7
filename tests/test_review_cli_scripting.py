"""The `pushgw` command as cron, CI and Ansible run it: exit statuses, signals, options."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_cli import PUSHGW, run


def _marmot_config(tmp_path: Path) -> Path:
    secret = tmp_path / "marmot.key"
    assert run("marmot", "keygen", "--secret-file", str(secret)).returncode == 0
    path = tmp_path / "pushgw.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"},
                "plugins": {
                    "enabled": ["marmot"],
                    "marmot": {
                        "server_secret_key_file": str(secret),
                        "inbox_relays": ["ws://127.0.0.1:6969"],
                        "apps": {
                            "com.example.ios": {
                                "type": "apns",
                                "keyfile": str(_apns_key(tmp_path)),
                                "key_id": "KEYID00001",
                                "team_id": "TEAMID0001",
                                "topic": "com.example.ios",
                            }
                        },
                        "apns": {"app": "com.example.ios"},
                    },
                },
            }
        )
    )
    return path


def _apns_key(tmp_path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "apns.p8"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def test_marmot_pubkey_takes_the_config_given_before_the_command(tmp_path: Path) -> None:
    """`pushgw -c FILE marmot pubkey` (docs/cli.md: `-c` before the command name works for
    every command): the subcommand's own `--config` default must not drop FILE."""
    config = _marmot_config(tmp_path)
    env = {"PUSHGW_CONFIG": ""}
    before = run("-c", str(config), "marmot", "pubkey", "--json", env=env)
    after = run("marmot", "pubkey", "--json", "-c", str(config), env=env)
    assert before.returncode == 0, before.stderr
    assert after.returncode == 0, after.stderr
    assert json.loads(before.stdout) == json.loads(after.stdout)
    assert set(json.loads(before.stdout)) == {"npub", "pubkey_hex"}


def _waits_on_flock(pid: int) -> bool:
    """Whether process `pid` is blocked on a flock (a `->` waiter line of /proc/locks)."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "->" and fields[5].split(":")[0] == str(pid):
            return True
    return False


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs /proc/locks")
def test_ctrl_c_while_waiting_for_another_migration_ends_the_command(tmp_path: Path) -> None:
    """Ctrl-C on `pushgw db upgrade` while another process migrates the same SQLite
    database (its flock held): status 130 at once, not when the other process is done."""
    db = tmp_path / "gw.db"
    with open(f"{db}.migrate-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen(
            [*PUSHGW, "db", "upgrade"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PUSHGW_CONFIG": "",
                "PUSHGW__STORE__URL": f"sqlite+aiosqlite:///{db}",
            },
        )
        try:
            deadline = time.monotonic() + 60
            while not _waits_on_flock(proc.pid):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "db upgrade never waited for the lock"
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail("db upgrade still waits for the migration lock after SIGINT")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130
    assert out == ""
    assert "Traceback" not in err


def test_ctrl_c_before_the_command_runs_is_quiet_130(tmp_path: Path) -> None:
    """SIGINT while the plugins' commands load (most of a short command's run): no
    KeyboardInterrupt traceback, status 130. The signal is sent from there, not raced."""
    script = (
        "import os, signal, sys\n"
        "import gateway.cli as cli\n"
        "real = cli._plugin_commands\n"
        "def interrupted(sub):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    real(sub)\n"
        "cli._plugin_commands = interrupted\n"
        "sys.exit(cli.main(['spark', 'list']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 130, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr


def test_sigterm_ends_a_command_as_a_shell_reports() -> None:
    """SIGTERM (CI's timeout) to a command: it ends, killed by the signal (shell: 143),
    without a traceback."""
    proc = subprocess.Popen(
        [*PUSHGW, "tokens", "retire", "/dev/stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert out == "" and "Traceback" not in err


def test_db_upgrade_and_check_config_are_idempotent(tmp_path: Path) -> None:
    config = _marmot_config(tmp_path)
    first = run("-c", str(config), "db", "upgrade")
    second = run("db", "upgrade", "-c", str(config))
    assert first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    assert first.stdout == second.stdout and first.stdout.startswith("database at head")
    checks = [run("-c", str(config), "check-config") for _ in range(2)]
    assert [c.returncode for c in checks] == [0, 0]
    assert checks[0].stdout == checks[1].stdout
    assert json.loads(checks[0].stdout)["apps"] == ["marmot/com.example.ios"]
    assert checks[0].stderr.startswith("configuration OK")


def test_usage_errors_are_status_2_one_line_on_stderr(tmp_path: Path) -> None:
    for args in (
        ["bogus"],
        ["serve", "--port", "70000"],
        ["-c", str(tmp_path / "missing.yaml"), "check-config"],
        ["receipts", "cat", str(tmp_path / "missing")],
        ["tokens", "retire", str(tmp_path / "missing.jsonl")],
        ["spark", "run"],
    ):
        result = run(*args, env={"PUSHGW_CONFIG": ""})
        assert result.returncode == 2, (args, result.stderr)
        assert result.stdout == ""
        errors = [line for line in result.stderr.splitlines() if not line.startswith(" ")]
        assert "error" in errors[-1] and "Traceback" not in result.stderr, args
