"""Security review of the HTTP-facing code: each test shows one finding (each failed
before its fix).

- Matrix notify: a `Content-Encoding` body escaped `max_body_bytes` (decompression
  bomb on an unauthenticated endpoint), and one that does not decode was a 500.
- Core middleware: a non-UTF-8 `X-Request-Id` was reflected into the response header;
  with aiohttp's pure-Python parser the response could not be written (connection
  dropped, ERROR traceback), on every route.

(The review's finding that anyone can trip an app's mass-invalidation guard is a known
limitation, documented in docs/delivery.md and docs/matrix.md; the Zulip findings are
in tests/zulip/test_review_security.py.)
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config

NOTIFY = "/_matrix/push/v1/notify"
IOS = "com.example.ios"
ANDROID = "com.example.android"
ROOT = Path(__file__).resolve().parent.parent


def _apns_pushkey() -> tuple[str, str]:
    raw = secrets.token_bytes(32)
    return base64.b64encode(raw).decode(), raw.hex()


def _notification(devices: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {
        "notification": {
            "event_id": "$event",
            "room_id": "!room:example.org",
            "type": "m.room.message",
            "sender": "@alice:example.org",
            "content": {"msgtype": "m.text", "body": "hi"},
            "counts": {"unread": 1},
            "devices": devices,
            **fields,
        }
    }


@pytest_asyncio.fixture
async def sims() -> AsyncIterator[tuple[ApnsSimulator, FcmSimulator]]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        yield apns, fcm


@pytest_asyncio.fixture
async def matrix_gw(
    sims: tuple[ApnsSimulator, FcmSimulator], tmp_path: Path
) -> AsyncIterator[GatewayHarness]:
    apns, fcm = sims
    section = {
        "apps": {
            IOS: apns_app_config(apns, tmp_path),
            ANDROID: fcm_app_config(fcm, tmp_path),
        },
        "notify_deadline": 3.0,
    }
    async with GatewayHarness(base_config(tmp_path, {"matrix": section})) as gw:
        yield gw


# --- Matrix notify: Content-Encoding ---------------------------------------------------------


async def test_matrix_gzip_body_cannot_escape_the_body_limit(matrix_gw: GatewayHarness) -> None:
    # `_read_body` compares the *Content-Length* (the compressed size) with
    # `max_body_bytes` (512 KiB) and then reads the whole body, which aiohttp inflates.
    # 20 kB on the wire become a 20 MiB notification here; a 512 KiB gzip body inflates
    # to about 500 MiB, held in memory and JSON-decoded, per unauthenticated request.
    pad = "a" * (20 * 1024 * 1024)
    body = json.dumps(_notification([{"app_id": "unknown.app", "pushkey": "k"}], pad=pad))
    compressed = gzip.compress(body.encode())
    assert len(compressed) < 512 * 1024 < len(body)
    response = await matrix_gw.client.post(
        NOTIFY,
        data=compressed,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert response.status == 413, (response.status, await response.text())


async def test_matrix_undecodable_content_encoding_is_a_400_not_a_500(
    matrix_gw: GatewayHarness, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/matrix.md: "Malformed input never gets a 500"; a body whose Content-Encoding
    # does not decode is the client's mistake (the zulip plugin answers it 400), but
    # here it is "internal error in notify" with a traceback at ERROR, every time.
    response = await matrix_gw.client.post(
        NOTIFY,
        data=b"this is not gzip",
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "plugins.matrix"]
    assert response.status == 400, response.status
    assert not errors


# --- core middleware: reflected X-Request-Id ---------------------------------------------


_PURE_PYTHON_PARSER_PROBE = textwrap.dedent(
    """
    import asyncio, sys, tempfile
    from pathlib import Path
    from gateway.testing.harness import GatewayHarness, base_config

    async def main():
        tmp = Path(tempfile.mkdtemp(dir=sys.argv[1]))
        async with GatewayHarness(base_config(tmp, {})) as gw:
            reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
            writer.write(
                b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\nX-Request-Id: \\xff\\xfe1\\r\\n"
                b"Connection: close\\r\\n\\r\\n"
            )
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            sys.stdout.write(data.split(b"\\r\\n", 1)[0].decode("latin-1") or "(nothing)")

    asyncio.run(main())
    """
)


def test_a_non_utf8_request_id_does_not_break_the_response(tmp_path: Path) -> None:
    # The middleware copies the client's X-Request-Id into the response. aiohttp's
    # pure-Python parser (AIOHTTP_NO_EXTENSIONS, or a platform without its C extension,
    # which gateway/app.py mentions) decodes header bytes with surrogateescape; writing
    # them back raises UnicodeEncodeError, so any request to any route (/healthz here)
    # gets no answer at all and the log an ERROR "Unhandled exception" traceback.
    env = {**os.environ, "AIOHTTP_NO_EXTENSIONS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", _PURE_PYTHON_PARSER_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("HTTP/1.1 200"), (result.stdout, result.stderr[-2000:])
