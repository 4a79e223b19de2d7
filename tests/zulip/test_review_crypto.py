"""Review of the zulip plugin's key handling and its `keys` commands: each test first
reproduced a bug (a private key in an error message, tracebacks from the key file, a key
file the documented set-up could not create)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from plugins.zulip.crypto import CryptoError, generate_bouncer_key, load_bouncer_keys


def _config(tmp_path: Path, keys_file: Path) -> Path:
    data = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
        "plugins": {"enabled": ["zulip"], "zulip": {"bouncer_keys_file": str(keys_file)}},
    }
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --- no private key in errors ------------------------------------------------------------


def test_swapped_key_map_does_not_echo_the_private_key() -> None:
    """`{private: public}` (the halves swapped, an easy slip when copying Zulip's
    `push_registration_encryption_keys`) must not put the private key in the error that
    `check-config`, `serve` and `keys list` print."""
    public, private = generate_bouncer_key()
    with pytest.raises(CryptoError) as raised:
        load_bouncer_keys({private: public})
    assert private not in str(raised.value)
    assert "swapped" in str(raised.value)


def test_mismatched_key_error_does_not_echo_the_map_key() -> None:
    """A map key cannot be told to be a public key until it matches: never echo it."""
    public, private = generate_bouncer_key()
    _, other_private = generate_bouncer_key()
    for keys in ({private: other_private}, {private: "not base64!"}, {private: "AAAA"}):
        with pytest.raises(CryptoError) as raised:
            load_bouncer_keys({public: private, **keys})
        assert private not in str(raised.value)
        assert "bouncer key 2" in str(raised.value)


def test_check_config_with_swapped_keys_does_not_print_the_private_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    public, private = generate_bouncer_key()
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({private: public}))
    config = _config(tmp_path, keys_file)
    assert main(["-c", str(config), "check-config"]) == 2
    captured = capsys.readouterr()
    assert private not in captured.out + captured.err
    assert main(["-c", str(config), "zulip", "keys", "list", "--file", str(keys_file)]) == 1
    captured = capsys.readouterr()
    assert private not in captured.out + captured.err


# --- key file problems are one line, not a traceback ----------------------------------------


@pytest.mark.parametrize(
    "command", [["generate"], ["add"], ["list"], ["remove", "AAAA"]], ids=lambda c: c[0]
)
def test_unreadable_key_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """A key file that cannot be read or written (here a directory; in practice a file
    owned by another user) ends the command with status 1 and one line."""
    directory = tmp_path / "keys.json"
    directory.mkdir()
    config = _config(tmp_path, tmp_path / "other.json")
    (tmp_path / "other.json").write_text("{}")
    status = main(["-c", str(config), "zulip", "keys", *command, "--file", str(directory)])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith(f"pushgw zulip: {directory}: ") and err.count("\n") == 1


def test_unwritable_key_file_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    target = blocker / "keys.json"
    config = _config(tmp_path, tmp_path / "other.json")
    (tmp_path / "other.json").write_text("{}")
    assert main(["-c", str(config), "zulip", "keys", "generate", "--file", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pushgw zulip: {target}: ") and err.count("\n") == 1


# --- the configured key file can be created and repaired by the commands --------------------


def test_keys_generate_creates_the_configured_key_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/zulip.md's production set-up names `/etc/pushgw/zulip-bouncer-keys.json` and then
    runs `pushgw zulip keys generate`: the file does not exist yet, and creating it is the
    command's job (it was refused as a config error: `bouncer_keys_file: file not found`)."""
    keys_file = tmp_path / "etc" / "zulip-bouncer-keys.json"
    config = _config(tmp_path, keys_file)
    assert main(["-c", str(config), "zulip", "keys", "generate"]) == 0
    public = capsys.readouterr().out.strip()
    assert set(load_bouncer_keys(json.loads(keys_file.read_text()))) == {public}
    assert main(["-c", str(config), "zulip", "keys", "list"]) == 0
    assert capsys.readouterr().out.split() == [public]


def test_keys_remove_repairs_a_broken_configured_key_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken entry in the configured file makes the config invalid; `keys remove` is
    how an operator takes it out, so it must not need the config to be valid first."""
    good_public, good_private = generate_bouncer_key()
    bad_public, _ = generate_bouncer_key()
    _, wrong_private = generate_bouncer_key()
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({good_public: good_private, bad_public: wrong_private}))
    config = _config(tmp_path, keys_file)
    assert main(["-c", str(config), "check-config"]) == 2
    capsys.readouterr()
    assert main(["-c", str(config), "zulip", "keys", "remove", bad_public]) == 0
    assert json.loads(keys_file.read_text()) == {good_public: good_private}
    assert main(["-c", str(config), "zulip", "keys", "list"]) == 0
    assert capsys.readouterr().out.split() == [good_public]
