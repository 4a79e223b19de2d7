"""Rolling restarts: `pushgw serve` stopped by SIGTERM while pushes are out to a provider
that is slow to answer. Found by review, each with a failing test first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.core.push import Attempt, Outcome, Push, PushPolicy, Reason, Receipt
from gateway.receipt_files import read_records
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import apns_app_config
from tests.core.test_dispatcher import ScriptedClient, scripted_dispatcher
from tests.serve_process import free_port, read_until, spawn_serve

ROOT = Path(__file__).resolve().parents[1]
PUSHKEY = "ab" * 32
STUCK = 600.0  # seconds the provider takes to answer: longer than any test runs


def _notify_body(n: int) -> dict[str, Any]:
    return {
        "notification": {
            "event_id": f"$event{n}",
            "room_id": "!room:example.org",
            "counts": {"unread": 1},
            "devices": [{"app_id": "com.example.ios", "pushkey": PUSHKEY}],
        }
    }


async def _serve(tmp_path: Path, apns: ApnsSimulator, port: int) -> asyncio.subprocess.Process:
    """`pushgw serve` (one process, Parquet receipts) against `apns`, once it listens."""
    app = apns_app_config(apns, tmp_path, topic="com.example.ios", request_timeout=STUCK)
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"host": "127.0.0.1", "port": port, "shutdown_timeout": 1.0},
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {"directory": str(tmp_path / "receipts"), "hmac_key": "k"},
                "plugins": {"enabled": ["matrix"], "matrix": {"apps": {"com.example.ios": app}}},
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PUSHGW_CONFIG", None)
    proc = await spawn_serve(config, env)
    await read_until(proc, [], r"Running on")
    return proc


async def test_a_notify_stuck_at_the_provider_is_answered_when_sigterm_comes(
    tmp_path: Path,
) -> None:
    """A homeserver's request whose push is out to a provider that does not answer: at
    SIGTERM the gateway used to wait `shutdown_timeout` (twice, in aiohttp), then cut the
    request handler and drop the connection: accepted, then no answer. Now the pushes
    still out at `shutdown_timeout` end transient/shutting_down and the homeserver gets
    the protocol's answer (502: retry), the log counts them, the process exits 0 and its
    Parquet file is published whole."""
    async with ApnsSimulator() as apns:
        apns.script_all(ApnsResponse.ok(delay=STUCK))
        port = free_port()
        proc = await _serve(tmp_path, apns, port)
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}/_matrix/push/v1/notify"
                answers = [
                    asyncio.ensure_future(session.post(url, json=_notify_body(n))) for n in range(2)
                ]
                await apns.wait_for_requests(2, timeout=60)  # both pushes are out
                proc.send_signal(signal.SIGTERM)
                statuses = []
                for answer in answers:
                    async with await answer as response:
                        statuses.append(response.status)
            assert proc.stderr is not None
            stderr = (await proc.stderr.read()).decode()
            assert await proc.wait() == 0, stderr
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    assert statuses == [502, 502], stderr
    assert "Traceback" not in stderr
    assert "2 push(es) still out after the shutdown timeout" in stderr, stderr
    assert "2 accepted push(es) not delivered" in stderr, stderr
    assert PUSHKEY not in stderr
    receipts = read_records(tmp_path / "receipts")
    assert [(r["status"], r["reason"], r["attempts"]) for r in receipts] == [
        ("transient", "shutting_down", 1)
    ] * 2
    assert [p.suffix for p in (tmp_path / "receipts").iterdir()] == [".parquet"]


# --- the dispatcher's cut: what `cut_after()` ends, and what it leaves alone --------------


def _ended(receipt: Receipt) -> tuple[Outcome, str | None, int | None, int]:
    return receipt.outcome, receipt.reason, receipt.status, receipt.attempts


async def test_the_cut_ends_pushes_out_or_waiting_and_leaves_later_ones_alone() -> None:
    """At the cut, a push in a request that does not end, one waiting 30 s to retry and
    one queued for the lane's only slot end transient/shutting_down at once, without their
    callers being cancelled (the handler must still answer); the queued one is never
    sent. A push accepted after the cut (a plugin service still finishing its work) is
    delivered as usual."""
    answers = {
        "stuck": asyncio.get_running_loop().create_future(),  # never set: a stuck provider
        "retry": Attempt(Outcome.TRANSIENT, 503, "Unavailable", retry_after=30.0),
        "later": Attempt(Outcome.OK, 200),
    }

    async def answer(push: Push) -> Attempt:
        result = answers[push.token]
        return await result if isinstance(result, asyncio.Future) else result

    client = ScriptedClient("android", answer)
    client.max_in_flight = 1  # `queued` waits for the slot `stuck` holds
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    policy = PushPolicy(deadline=50)
    retrying = asyncio.create_task(
        dispatcher.send(Push("p", "android", "retry", {}, policy=policy))
    )
    await client.called.wait()  # answered 503: it now waits 30 s to retry
    client.called.clear()
    stuck = asyncio.create_task(dispatcher.send(Push("p", "android", "stuck", {}, policy=policy)))
    await client.called.wait()  # its request is out, holding the one slot
    queued = asyncio.create_task(dispatcher.send(Push("p", "android", "queued", {}, policy=policy)))
    await asyncio.sleep(0)  # one loop step: it reaches the slot's queue (no time passes)

    dispatcher.cut_after(0)
    ends = await asyncio.gather(retrying, stuck, queued)
    assert [_ended(r) for r in ends] == [
        (Outcome.TRANSIENT, Reason.SHUTTING_DOWN, 503, 1),
        (Outcome.TRANSIENT, Reason.SHUTTING_DOWN, None, 1),
        (Outcome.TRANSIENT, Reason.SHUTTING_DOWN, None, 0),
    ]
    assert client.sent == ["retry", "stuck"]
    assert sorted(r.push_id for r in receipts) == sorted(r.push_id for r in ends)

    later = await dispatcher.send(Push("p", "android", "later", {}, policy=policy))
    assert _ended(later) == (Outcome.OK, None, 200, 1)
    await dispatcher.close()


async def test_pushes_cancelled_at_shutdown_are_counted_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Pushes that shutdown ended undelivered (here: cancelled with the request handler
    aiohttp cut) had receipts but not a word in the log: the operator restarting a node
    could not tell that anything was abandoned. One line counts them."""
    never = asyncio.get_running_loop().create_future()

    async def answer(_push: Push) -> Attempt:
        return await never  # type: ignore[no-any-return]

    client = ScriptedClient("android", answer)
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    handlers = [
        asyncio.create_task(dispatcher.send(Push("p", "android", f"t{n}", {}))) for n in range(3)
    ]
    while len(client.sent) < 3:
        await client.called.wait()
        client.called.clear()
    for handler in handlers:
        handler.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)
    with caplog.at_level(logging.WARNING, logger="gateway.core.dispatcher"):
        await dispatcher.drain(timeout=1)
        await dispatcher.close()
    assert [r.reason for r in receipts] == [Reason.SHUTTING_DOWN] * 3
    assert "shutdown: 3 accepted push(es) not delivered" in caplog.text
