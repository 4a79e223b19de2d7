"""Support: "I stopped getting notifications". From the user's device token to its
receipts (`pushgw tokens hash`) and to whether, when and why it was retired
(`pushgw tokens status`), with nothing but the `pushgw` command, never showing the token."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main as pushgw
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from tests.conftest import offline_apns_app

ALIVE = "a1" * 32
GONE = "b2" * 32  # the user's phone: Apple says Unregistered
FCM_TOKEN = "dQw4w9WgXcQ:APA91bH" + "x" * 140


def stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """What a pipe gives the command (`pushgw tokens hash < token.txt`)."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = await asyncio.to_thread(pushgw, list(argv))
    out, err = capsys.readouterr()
    return status, out, err


async def serve_pushes(tmp_path: Path, store_url: str | None = None) -> Path:
    """A real gateway (the sample plugin, the APNs simulator, a key file) pushes to ALIVE
    and GONE and stops, publishing its receipts; returns its config file."""
    key_file = tmp_path / "hmac.key"
    key_file.write_text("support-case-secret-key\n")
    async with ApnsSimulator() as apns:
        config = base_config(
            tmp_path, {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}}
        )
        del config["receipts"]["hmac_key"]
        config["receipts"].update(hmac_key_file=str(key_file), format="parquet")
        if store_url is not None:
            config["store"]["url"] = store_url
        apns.script(GONE, ApnsResponse.error("Unregistered"))
        async with GatewayHarness(config) as gw:
            for token in (ALIVE, GONE):
                body = {"app": "ios", "token": token, "payload": {"aps": {"alert": "hi"}}}
                assert (await gw.client.post("/sample/push", json=body)).status == 200
    # the simulator's CA went with it: the same app, pointed at Apple, for the commands
    config["plugins"]["sample"]["apps"]["ios"] = offline_apns_app(tmp_path)
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_tokens_hash_finds_the_devices_receipts(
    sample_plugin_installed: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = await serve_pushes(tmp_path)
    status, out, err = await run(capsys, "receipts", "cat", "--config", str(config))
    assert status == 0, err
    receipts = [json.loads(line) for line in out.splitlines()]
    assert len(receipts) == 2 and GONE not in out

    # the token as pasted from the app's debug screen: with its newline
    stdin(monkeypatch, f"{GONE}\n".encode())
    status, out, err = await run(capsys, "tokens", "hash", "--config", str(config))
    assert status == 0 and err == ""  # a key is set: no warning
    (token_hash,) = out.split()
    mine = [r for r in receipts if r["token_hash"] == token_hash]
    assert [(r["status"], r["reason"]) for r in mine] == [("token_invalid", "Unregistered")]
    assert GONE not in out + err

    # several tokens, one a line; blank lines left out
    stdin(monkeypatch, f"{ALIVE}\n\n{GONE}\n".encode())
    status, out, _ = await run(capsys, "tokens", "hash", "--config", str(config))
    by_status = {r["status"]: r["token_hash"] for r in receipts}
    assert (status, out.split()) == (0, [by_status["ok"], by_status["token_invalid"]])


async def test_tokens_hash_from_an_argument_warns_and_bad_input_is_refused(
    sample_plugin_installed: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = await serve_pushes(tmp_path)
    stdin(monkeypatch, f"{GONE}\n".encode())
    _, from_stdin, _ = await run(capsys, "tokens", "hash", "--config", str(config))
    status, out, err = await run(capsys, "tokens", "hash", GONE, "--config", str(config))
    assert (status, out) == (0, from_stdin)
    assert "shell's history" in err and GONE not in err

    for data in (b"\xff" + GONE.encode() + b"\n", b"\n  \n"):
        stdin(monkeypatch, data)
        status, out, err = await run(capsys, "tokens", "hash", "--config", str(config))
        assert status == 2 and out == "" and err.startswith("pushgw: error:")
        assert GONE not in err and "Traceback" not in err


async def test_tokens_hash_without_a_key_says_which_key_it_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PUSHGW_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    stdin(monkeypatch, f"{GONE}\n".encode())
    status, out, err = await run(capsys, "tokens", "hash")
    assert status == 0 and len(out.strip()) == 64
    assert "receipts.hmac_key is not set" in err and GONE not in err


async def test_tokens_status_says_when_and_why_a_token_was_retired(
    sample_plugin_installed: str,
    tmp_path: Path,
    store_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = await serve_pushes(tmp_path, store_url)
    stdin(monkeypatch, f"{GONE}\n{ALIVE}\n".encode())
    _, out, _ = await run(capsys, "tokens", "hash", "--config", str(config))
    gone_hash, alive_hash = out.split()

    status, out, err = await run(
        capsys, "tokens", "status", gone_hash.upper(), alive_hash, "--config", str(config)
    )
    assert status == 0
    (record,) = [json.loads(line) for line in out.splitlines()]
    when: Any = record.pop("invalidated_at")
    assert record == {
        "plugin": "sample",
        "app_id": "ios",
        "token_hash": gone_hash,
        "provider": "apns",
        "reason": "Unregistered",
    }
    assert when.endswith("+00:00")
    assert "HASH 2: no dead-token record" in err and "30 days" in err
    assert "HASH 1" not in err and alive_hash not in err  # an APNs token looks like a hash

    # a (FCM) token itself instead of its hash: refused, and not echoed
    status, out, err = await run(capsys, "tokens", "status", FCM_TOKEN, "--config", str(config))
    assert status == 2 and out == "" and FCM_TOKEN not in err
    assert "`pushgw tokens hash` makes one from a token" in err
