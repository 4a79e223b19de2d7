"""Security review of the day's additions: `pushgw db backup` in a directory others
share (symlinks, races, the copy's permissions) and the CONNECT answer of a hostile
proxy quoted in log lines and a push's `detail`.

Real SQLite files and the real `pushgw` command line, in process (the race is staged by
wrapping `sqlite_backup`, the one place that makes the file); the real APNs and FCM
simulators (TLS) behind the egress review's CONNECT proxy, answering with a reason
phrase of its choosing.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import gateway.core.store as store
from gateway import cli, logs
from gateway.core.push import Outcome, Reason
from gateway.testing import ApnsSimulator, FcmSimulator
from tests.test_review_egress_proxy import (
    PROXY_PASSWORD,
    ConnectProxy,
    apns_client,
    apns_push,
    connect_proxy,
    fcm_client,
    fcm_push,
    new_log_lines,
)

SECRET = "zulip-device-token-in-clear"


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)  # the usual one: new files world-readable
    try:
        yield
    finally:
        os.umask(previous)


def pushgw_db(path: Path, mode: int = 0o600) -> str:
    """A database as `db backup` accepts it (an `alembic_version` table), holding a
    secret, with `mode`; its URL."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('core_0001')")
        conn.execute("CREATE TABLE devices (token TEXT)")
        conn.execute("INSERT INTO devices VALUES (?)", (SECRET,))
    conn.close()
    path.chmod(mode)
    return f"sqlite+aiosqlite:///{path}"


def tokens_in(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [row[0] for row in conn.execute("SELECT token FROM devices")]
    finally:
        conn.close()


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_backup_is_no_more_readable_than_the_database(
    tmp_path: Path, umask_022: None, mode: int
) -> None:
    url = pushgw_db(tmp_path / "pushgw.db", mode)
    shared = tmp_path / "shared"
    shared.mkdir()
    dest = shared / "b.db"

    assert store.sqlite_backup(url, dest) == ["core_0001"]

    assert stat.S_IMODE(dest.stat().st_mode) == mode  # umask 022 alone gave 0644
    assert tokens_in(dest) == [SECRET]
    assert sorted(p.name for p in shared.iterdir()) == ["b.db"]  # no temporary file left


def test_backup_never_follows_a_symlink_planted_at_the_temporary_name(
    tmp_path: Path, umask_022: None
) -> None:
    """Another user of a shared directory knew the temporary name (`.NAME.partial-PID`)
    and left a symlink there: SQLite wrote the copy (device tokens) through it into a
    file of theirs, and the rename made `dest` that symlink."""
    url = pushgw_db(tmp_path / "pushgw.db")
    shared = tmp_path / "shared"
    shared.mkdir()
    theirs = tmp_path / "attacker"
    theirs.mkdir()
    dest = shared / "b.db"
    loot = theirs / "loot.db"
    (shared / f".b.db.partial-{os.getpid()}").symlink_to(loot)

    store.sqlite_backup(url, dest)

    assert not loot.exists()
    assert not dest.is_symlink()
    assert tokens_in(dest) == [SECRET]


def test_backup_never_replaces_a_file_or_symlink_made_at_dest_meanwhile(
    tmp_path: Path, umask_022: None
) -> None:
    """`dest` did not exist when the command checked, and does when the copy is done
    (another run, another user): it is left as it is, the copy is not kept."""
    url = pushgw_db(tmp_path / "pushgw.db")
    shared = tmp_path / "shared"
    shared.mkdir()
    older = shared / "older.db"
    older.write_text("an older backup")
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's file")

    with pytest.raises(FileExistsError):
        store.sqlite_backup(url, older)
    assert older.read_text() == "an older backup"

    link = shared / "link.db"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        store.sqlite_backup(url, link)
    assert link.is_symlink() and os.readlink(link) == str(victim)
    assert victim.read_text() == "someone's file"
    assert sorted(p.name for p in shared.iterdir()) == ["link.db", "older.db"]


def test_db_backup_command_refuses_a_dest_made_during_the_copy(
    tmp_path: Path,
    umask_022: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = pushgw_db(tmp_path / "pushgw.db")
    config = tmp_path / "pushgw.yaml"
    config.write_text(yaml.safe_dump({"store": {"url": url}}))
    dest = tmp_path / "b.db"
    real = store.sqlite_backup

    def racing(url: str, dest: Path) -> list[str]:
        dest.write_text("made after the command's check")
        return real(url, dest)

    monkeypatch.setattr(store, "sqlite_backup", racing)

    status = cli.main(["-c", str(config), "db", "backup", str(dest)])

    err = capsys.readouterr().err
    assert status == 2, err
    assert f"{dest}: already exists: give the name of a new file" in err
    assert dest.read_text() == "made after the command's check"


# --- a hostile proxy's reason phrase in logs and details --------------------------------

FORGED = "ERROR gateway.dispatcher [-] forged entry"
# CR (http.client keeps it inside the reason), NEL (latin-1 \x85), an escape sequence
# that clears the reader's terminal, and a lone LF (the APNs tunnel splits on CRLF only)
HOSTILE = (
    b"HTTP/1.1 403 Forbidden\r" + FORGED.encode() + b"\x1b[2J\x85" + FORGED.encode() + b"\n"
    b"<2>" + FORGED.encode() + b"\r\nContent-Length: 0\r\n\r\n"
)


@pytest.fixture
async def proxy() -> AsyncIterator[ConnectProxy]:
    async with connect_proxy() as running:
        yield running


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch, register_secret: Any) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "SSL_CERT_FILE"):
        monkeypatch.delenv(name, raising=False)
    register_secret(PROXY_PASSWORD)


def journal_entries(line: str) -> list[str]:
    """The journal entries one log record with message `line` becomes under systemd."""
    record = logging.LogRecord("gateway.core.fcm", logging.WARNING, __file__, 1, line, (), None)
    record.request_id = "-"
    return logs.JournalFormatter().format(record).splitlines()


def assert_one_clean_line(text: str) -> None:
    assert text.isprintable(), repr(text)
    assert len(journal_entries(text)) == 1


async def test_a_proxy_reason_phrase_cannot_forge_log_lines_for_the_oauth_token(
    proxy: ConnectProxy, tmp_path: Path
) -> None:
    """The proxy refusing the OAuth token request's CONNECT: its reason phrase went into
    the WARNING line as it came, a CR or NEL in it splitting the line (under systemd,
    one journal entry per piece, the forged one as the gateway's) and an escape
    sequence reaching the reader's terminal."""
    async with FcmSimulator(tls=True) as fcm_sim:
        proxy.refusals.append(HOSTILE)
        with new_log_lines() as lines:
            async with fcm_client(fcm_sim, tmp_path, proxy=proxy.url) as client:
                attempt = await client.send(fcm_push())
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail is not None
    assert f"proxy {proxy.label} refused CONNECT: 403 Forbidden?ERROR" in attempt.detail
    assert_one_clean_line(attempt.detail)
    warnings = [line for line in lines if " WARNING " in line and "OAuth token" in line]
    assert len(warnings) == 1, lines
    assert "refused CONNECT: 403 Forbidden" in warnings[0]
    assert_one_clean_line(warnings[0])
    assert PROXY_PASSWORD not in "\n".join(lines)


async def test_a_proxy_reason_phrase_reaches_an_apns_detail_printable(
    proxy: ConnectProxy, tmp_path: Path
) -> None:
    async with ApnsSimulator() as apns_sim:
        proxy.refusals.append(HOSTILE)
        async with apns_client(
            apns_sim.host, apns_sim.port, apns_sim.ca_path, tmp_path, proxy=proxy.url, sim=apns_sim
        ) as client:
            attempt = await client.send(apns_push())
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail is not None
    assert f"proxy {proxy.label} refused CONNECT to {apns_sim.host}:{apns_sim.port}" in (
        attempt.detail
    )
    assert " 403 Forbidden?ERROR" in attempt.detail
    assert_one_clean_line(attempt.detail)
