"""Deployed as a twelve-factor app (containers, Kubernetes): configuration from the
environment and mounted secret files, a read-only root file system but for the
directories the configuration declares, start-up errors as one line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
import yaml

from gateway import cli, serve
from gateway.app import load_gateway

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    return {**env, **extra}


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_serve_refuses_a_receipts_directory_it_cannot_make(tmp_path: Path) -> None:
    # Found only at the first receipt, such a directory let the gateway report ready
    # while every receipt waited in memory, to be lost at exit.
    (tmp_path / "a-file").write_text("")
    receipts = tmp_path / "a-file" / "receipts"
    config = write_config(
        tmp_path / "pushgw.yaml",
        {
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
            "receipts": {"directory": str(receipts)},
        },
    )
    result = subprocess.run(
        [*PUSHGW, "serve", "--config", str(config), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,  # a guard: without the check the server runs until killed
        env=clean_env(),
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"pushgw: error: receipts.directory {receipts}: cannot create it: not a directory\n"
    )
    assert not (tmp_path / "pushgw.db").exists()  # refused before anything was migrated


def test_serve_with_receipts_disabled_does_not_check_their_directory(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    config = write_config(
        tmp_path / "pushgw.yaml",
        {"receipts": {"enabled": False, "directory": str(tmp_path / "a-file" / "r")}},
    )
    serve._check_receipts_directory(load_gateway(config))  # no ServeError


def test_serve_workers_without_a_writable_temporary_directory_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A read-only root file system with no writable /tmp: the workers' shared metrics
    # directory cannot be made. One line, status 2, not a traceback out of tempfile.
    for name in list(os.environ):
        if name.upper().startswith("PUSHGW"):
            monkeypatch.delenv(name)
    config = write_config(
        tmp_path / "pushgw.yaml",
        {
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
            "receipts": {"directory": str(tmp_path / "receipts")},
        },
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    status = cli.main(
        ["serve", "--config", str(config), "--port", str(free_port()), "--workers", "2"]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert err == (
        "pushgw: error: 2 workers need a writable temporary directory for their metrics "
        "(mount one, or set TMPDIR to one): no such file or directory\n"
    )


def _read_only_root_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --bind / / && mount -o remount,ro,bind /"],
        capture_output=True,
    )
    return probe.returncode == 0


READ_ONLY_ROOT = (
    # A private mount namespace: `writable` bound onto itself stays writable while the
    # root is made read-only, as a container's readOnlyRootFilesystem with one volume.
    'w="$1"; shift; mount --bind "$w" "$w" && mount -o remount,ro,bind / && exec "$@"'
)


@pytest.mark.skipif(
    not _read_only_root_available(), reason="needs mount namespaces (unshare -m, root)"
)
def test_serve_on_a_read_only_root_writes_only_its_declared_directories(tmp_path: Path) -> None:
    writable = tmp_path / "state"
    writable.mkdir()
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    # Secrets as Kubernetes mounts them: symlinks into `..data`, trailing newline.
    secrets = tmp_path / "secrets"
    (secrets / "..2025_01_01").mkdir(parents=True)
    (secrets / "..2025_01_01" / "hmac").write_text("from-a-secret-file\n")
    (secrets / "..data").symlink_to("..2025_01_01")
    (secrets / "hmac").symlink_to("..data/hmac")
    config = write_config(
        cwd / "pushgw.yaml",
        {
            "store": {"url": f"sqlite+aiosqlite:///{writable / 'pushgw.db'}"},
            "receipts": {"directory": str(writable / "receipts")},
        },
    )
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "PUSHGW_CONFIG": str(config),
        "PUSHGW__SERVER__PORT": str(port),
        "PUSHGW__RECEIPTS__HMAC_KEY_FILE": str(secrets / "hmac"),
    }
    before = sorted(p.name for p in [*cwd.iterdir(), *home.iterdir()])
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", READ_ONLY_ROOT, "sh", str(writable), *PUSHGW, "serve"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # the gateway says when it listens
            lines.append(line)
            if "Running on" in line:
                break
        else:
            pytest.fail(f"serve ended: {''.join(lines)}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30) as resp:
            ready = json.loads(resp.read())
        assert ready["ready"] is True and ready["receipts"] is True
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "Traceback" not in rest
    assert sorted(p.name for p in [*cwd.iterdir(), *home.iterdir()]) == before
    assert (writable / "receipts").is_dir()


def test_check_config_masks_secrets_set_from_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "hmac"
    key_file.write_text("Sekrit-From-File\n")  # as `echo ... > file` writes it
    config = write_config(tmp_path / "pushgw.yaml", {"receipts": {"hmac_key": "in-the-file"}})
    result = subprocess.run(
        [*PUSHGW, "check-config", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(
            PUSHGW__RECEIPTS__HMAC_KEY_FILE=str(key_file),
            PUSHGW__STORE__URL="postgresql+asyncpg://pushgw:Env-Pa55word@db/pushgw",
            PUSHGW__SERVER='{"port": 8080}',
        ),
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["receipts"]["hmac_key"] == "**********"
    assert shown["store"]["url"] == "postgresql+asyncpg://pushgw:***@db/pushgw"
    assert shown["server"]["port"] == 8080 and shown["server"]["host"] == "127.0.0.1"
    for secret in ("Sekrit-From-File", "Env-Pa55word", "in-the-file"):
        assert secret not in result.stdout + result.stderr


def test_secret_file_trailing_newline_is_not_part_of_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.config import load_settings

    key_file = tmp_path / "hmac"
    key_file.write_text("the-key\n")
    monkeypatch.setenv("PUSHGW__RECEIPTS__HMAC_KEY_FILE", str(key_file))
    settings = load_settings(data={})
    assert settings.receipts.hmac_key.get_secret_value() == "the-key"
