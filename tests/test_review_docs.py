"""Behaviour the operator documentation promises, where a docs review found the code
doing otherwise (each test failed before its fix)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError

from gateway.config import ApnsAppConfig

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def _pushgw(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # The timeout only keeps a regression (simulators that do start) from hanging the run.
    return subprocess.run(
        [*PUSHGW, *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


# --- `pushgw simulate`: a bad argument is one line and status 2, never a traceback ---------
# docs/cli.md: "a mistake to fix first: bad argument ... status 2"; "Errors go to stderr,
# one line per problem, and never as a traceback (a traceback is a bug of ours)".


@pytest.mark.parametrize(
    "mistake",
    [
        ["--state-dir", "{tmp}/some.yaml"],  # a file, not a directory
        ["--state-dir", "{tmp}/sim", "--host", "exa mple..com"],  # no host name
    ],
    ids=["state-dir-is-a-file", "host-is-no-host-name"],
)
def test_simulate_with_a_bad_argument_is_one_line(tmp_path: Path, mistake: list[str]) -> None:
    # `pushgw serve` says the same of the same mistakes (`--with-simulators DIR: not a
    # directory`, `not a valid host name (...)`), status 2.
    (tmp_path / "some.yaml").write_text("x: 1\n")
    args = [arg.format(tmp=tmp_path) for arg in mistake]
    result = _pushgw("simulate", *args, "--apns-port", "0", "--fcm-port", "0", cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("pushgw: error:"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# --- `pushgw serve --with-simulators`: simulators that cannot listen ----------------------
# docs/cli.md: status 2 is "a port that cannot be listened on". `pushgw simulate` exits 2
# when its port is in use; `serve --with-simulators` turns the same failure into status 1.


def test_serve_with_simulators_that_cannot_listen_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway import cli, serve

    real_popen = subprocess.Popen
    failing_simulators = (
        "import sys; print('pushgw: error: cannot start the simulators: error while "
        "attempting to bind on address (127.0.0.1, 2197): address already in use', "
        "file=sys.stderr); sys.exit(2)"
    )

    def popen(args: Any, *rest: Any, **kwargs: Any) -> Any:  # what `pushgw simulate` does
        return real_popen([sys.executable, "-c", failing_simulators], *rest, **kwargs)

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        try:
            status = cli.main(["serve", "--with-simulators", str(tmp_path / "sim")])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert status == 2


# --- logging.access_log: "paths only; no bodies" (config/production.example.yaml) ---------
# aiohttp's default access-log format logs the request line with its query string, and
# the Zulip bouncer reads its form fields (`token`, ...) from the query string too: with
# `access_log: true`, device tokens sent that way end up in the log.


def test_serve_logs_access_by_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway import logs, serve
    from gateway.app import load_gateway

    loaded = load_gateway(
        data={
            "server": {"event_loop": "asyncio"},
            "logging": {"access_log": True},
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
            "receipts": {"directory": str(tmp_path / "receipts")},
        }
    )
    captured: dict[str, Any] = {}
    monkeypatch.setattr(web, "run_app", lambda app, **kwargs: captured.update(kwargs))
    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)
    monkeypatch.setattr(asyncio, "set_event_loop", lambda loop: None)
    try:
        serve._run_loaded(loaded, [])
    finally:
        if "loop" in captured:
            captured["loop"].close()
    assert captured["access_log_class"] is logs.RouteAccessLogger
    assert captured["access_log"] is logging.getLogger("aiohttp.access")


async def test_the_access_log_names_the_route_not_the_path_or_query(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Device tokens travel in query strings (the Zulip bouncer reads its form fields
    from there too) and may travel in paths: an access line names the route's pattern,
    never the request's path or query, nor its Referer."""
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.logs import RouteAccessLogger

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/api/v1/remotes/push/register", ok)
    app.router.add_get("/devices/{pushkey}", ok)
    secret = "DEVICETOKEN0123456789abcdef"
    access = logging.getLogger("aiohttp.access")
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        server = TestServer(app)
        await server.start_server(access_log_class=RouteAccessLogger, access_log=access)
        async with TestClient(server) as client:  # its close waits for the handlers
            referer = {"Referer": f"https://example.com/?token={secret}"}
            register = f"/api/v1/remotes/push/register?token={secret}&token_kind=1"
            assert (await client.post(register, headers=referer)).status == 200
            assert (await client.get(f"/devices/{secret}")).status == 200
            assert (await client.get(f"/nowhere/{secret}")).status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len(lines) == 3
    assert '"POST /api/v1/remotes/push/register HTTP/1.1" 200' in lines[0]
    assert '"GET /devices/{pushkey} HTTP/1.1" 200' in lines[1]
    assert '"GET unmatched HTTP/1.1" 404' in lines[2]
    assert not any(secret in line for line in lines)


# --- an APNs app's `port` ---------------------------------------------------------------
# docs/configuration.md: wrong values are configuration errors and `check-config`
# validates what a start needs; `store.url` refuses a port beyond 65535 and
# `server.port` is 0 to 65535. An app's `port: 70000` passes `check-config` and every
# push through the app ends transient/connection_error after its retries; `port: 0`
# silently means 443.


@pytest.mark.parametrize("port", [-1, 0, 65536, 70000])
def test_an_apns_app_port_out_of_range_is_a_configuration_error(tmp_path: Path, port: int) -> None:
    keyfile = tmp_path / "AuthKey.p8"
    keyfile.write_text("not checked by the model\n")
    with pytest.raises(ValidationError):
        ApnsAppConfig.model_validate(
            {
                "type": "apns",
                "keyfile": str(keyfile),
                "key_id": "ABC123DEFG",
                "team_id": "TEAM123456",
                "topic": "com.example.ios",
                "host": "127.0.0.1",
                "port": port,
            }
        )
