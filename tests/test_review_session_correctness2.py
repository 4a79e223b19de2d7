"""Review of this session's own changes (correctness), against the code around them.

- `pushgw tokens status` is a lookup: run without the gateway's configuration (no `-c`,
  no `$PUSHGW_CONFIG`) or with a `store.url` naming no database, it made and migrated
  an empty SQLite database (`var/pushgw.db` in the working directory) and answered
  "not retired in the last 30 days", status 0: a support engineer who forgot `-c` was
  told that the user's token was never retired.
- `pushgw tokens hash < token.txt` hashed a UTF-8 byte order mark with the token.
"""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import pytest
import yaml

from gateway.cli import main as pushgw

SOME_HASH = "ab" * 32


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = await asyncio.to_thread(pushgw, list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def no_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A working directory of its own, and no configuration from the environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PUSHGW_CONFIG", raising=False)
    for name in [n for n in os.environ if n.startswith("PUSHGW__")]:
        monkeypatch.delenv(name)
    return tmp_path


async def test_tokens_status_without_a_configuration_makes_no_database(
    no_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = await run(capsys, "tokens", "status", SOME_HASH)
    assert (status, out) == (1, ""), err
    assert "no --config or $PUSHGW_CONFIG: using the built-in defaults" in err
    assert "no such database" in err and "not retired" not in err
    assert not (no_config / "var").exists()  # nothing made in the working directory


async def test_tokens_status_on_a_missing_sqlite_file_makes_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `store.url` with a typo in the path (or the config of another host)."""
    missing = tmp_path / "data" / "pushgw.db"
    config = tmp_path / "pushgw.yaml"
    config.write_text(yaml.safe_dump({"store": {"url": f"sqlite+aiosqlite:///{missing}"}}))
    status, out, err = await run(capsys, "tokens", "status", SOME_HASH, "--config", str(config))
    assert (status, out) == (1, ""), err
    assert f"{missing}: no such database" in err
    assert "no --config" not in err  # a configuration was given
    assert not missing.parent.exists()


async def test_tokens_status_on_an_existing_empty_database_still_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check is for the file only: a database the gateway made answers as before."""
    db = tmp_path / "pushgw.db"
    config = tmp_path / "pushgw.yaml"
    config.write_text(yaml.safe_dump({"store": {"url": f"sqlite+aiosqlite:///{db}"}}))
    status, _, err = await run(capsys, "db", "upgrade", "--config", str(config))
    assert status == 0, err
    status, out, err = await run(capsys, "tokens", "status", SOME_HASH, "--config", str(config))
    assert (status, out) == (0, ""), err
    assert "HASH 1: no dead-token record" in err


# --- `pushgw tokens hash` from a file a Windows editor saved ---------------------------

TOKEN = "c3" * 32


async def test_tokens_hash_ignores_a_utf8_byte_order_mark(
    no_config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pushgw tokens hash < token.txt` with a file saved as "UTF-8" by Notepad (a byte
    order mark first) hashed U+FEFF with the token: a hash no receipt carries, and the
    user's receipts looked absent. The mark is not part of the token."""

    def stdin(data: bytes) -> None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))

    stdin(f"{TOKEN}\n".encode())
    status, plain, err = await run(capsys, "tokens", "hash")
    assert status == 0 and len(plain.strip()) == 64, err
    stdin(b"\xef\xbb\xbf" + f"{TOKEN}\r\n".encode())
    status, marked, err = await run(capsys, "tokens", "hash")
    assert (status, marked) == (0, plain), err
    assert TOKEN not in err
