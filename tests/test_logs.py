"""`logging.level: DEBUG` shows pushgw's own debug lines, never what libraries log."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway import logs
from gateway.core.store import create_engine
from gateway.testing.harness import GatewayHarness, base_config
from tests.conftest import configured_logging


@pytest.fixture
def debug_stderr() -> Iterator[io.StringIO]:
    """`logs.configure("DEBUG")` writing to a buffer (`configured_logging`)."""
    with configured_logging("DEBUG") as buffer:
        yield buffer


async def test_debug_level_keeps_sql_parameters_out_of_the_log(
    debug_stderr: io.StringIO, tmp_path: Path
) -> None:
    token = "f00dfeed" * 8  # what a registration writes
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'store.db'}")
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE devices (token TEXT)"))
            await conn.execute(sa.text("INSERT INTO devices VALUES (:t)"), {"t": token})
    finally:
        await engine.dispose()
    logging.getLogger("gateway.core.store").debug("stored a device")

    written = debug_stderr.getvalue()
    assert "stored a device" in written  # the gateway's own DEBUG lines are shown
    assert token not in written


def test_level_above_warning_also_holds_for_the_quiet_loggers() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        logs.configure("ERROR")
        assert {logging.getLogger(name).level for name in logs.QUIET_LOGGERS} == {logging.ERROR}
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        logs.quiet_third_party()


def _raise_chained(secret: str) -> None:
    try:
        raise KeyError(secret)
    except KeyError as exc:
        raise RuntimeError(f"could not send to {secret}") from exc


@pytest.mark.parametrize("json_format", [False, True])
def test_tracebacks_keep_frames_and_types_but_not_messages(json_format: bool) -> None:
    secret = "0badc0de" * 8  # a device token an exception message quotes
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    buffer = io.StringIO()
    try:
        logs.configure("INFO", json_format=json_format)
        handler = root.handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(buffer)
        try:
            _raise_chained(secret)
        except RuntimeError:
            logging.getLogger("gateway.test").exception("sending failed")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        logs.quiet_third_party()
    written = buffer.getvalue()
    assert "sending failed" in written
    assert "_raise_chained" in written  # the frames are there
    assert "KeyError" in written and "RuntimeError" in written  # both links of the chain
    assert secret not in written


async def test_an_undecodable_request_body_is_one_line_not_a_traceback(
    debug_stderr: io.StringIO, tmp_path: Path
) -> None:
    """aiohttp drains a body after the answer and logs its decoding error again, as an
    "Unhandled exception" traceback: a client's mistake, so one INFO line instead."""
    body = b"not gzip at all, and " + b"secret-looking-content" * 4
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        server = gw.client.server
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(
                b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            answer = await reader.read()  # to EOF: aiohttp logs before it closes
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 405")
    written = debug_stderr.getvalue()
    assert "INFO aiohttp.server" in written
    assert "a request body could not be read" in written
    assert "Traceback" not in written and "Unhandled exception" not in written
    assert b"secret-looking-content".decode() not in written


@pytest.mark.parametrize("access_log", [True, False])
async def test_the_harness_logs_requests_as_serve_does(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, access_log: bool
) -> None:
    """`GatewayHarness` logs requests with `pushgw serve`'s access logger (the route,
    never the path) and only when `logging.access_log` is on, so that what a test sees in
    the log is what production writes. It used aiohttp's own access log, path included:
    a test requesting a token-like path put it in the suite's log."""
    secret = "f00dfeed" * 8
    config = base_config(tmp_path, {}, logging={"access_log": access_log})
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        async with GatewayHarness(config) as gw:
            assert (await gw.client.get(f"/devices/{secret}")).status == 404
            assert (await gw.client.get("/healthz")).status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert not [line for line in lines if secret in line]
    if access_log:
        assert len(lines) == 2
        assert '"GET unmatched HTTP/1.1" 404' in lines[0]
        assert '"GET /healthz HTTP/1.1" 200' in lines[1]
    else:
        assert lines == []
