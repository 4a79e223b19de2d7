"""Review: HTTP/2 connection lifecycle toward APNs, against the simulator (real TLS, h2).

- A GOAWAY naming a last stream below some in-flight requests: those above it were not
  processed and go out again on a new connection, once; those at or below it keep their
  own answers (sent again, a push already accepted by Apple would wake a device twice).
- RST_STREAM REFUSED_STREAM (not processed: sent again at once) against INTERNAL_ERROR and
  CANCEL (may have been processed: `transient`, the dispatcher's retry decides).
- A server that stops answering: the connection is noticed dead by an unanswered PING
  and left, so that the next pushes do not all time out on it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from h2.errors import ErrorCodes

from gateway.core.apns import ApnsClient, _ApnsProtocol
from gateway.core.push import ApnsOptions, Outcome, Push, Reason
from gateway.testing import ApnsResponse, ApnsSimulator
from tests.apns_clients import MakeClient, started_clients


def token() -> str:
    return secrets.token_hex(32)


def push_for(tok: str) -> Push:
    return Push(
        plugin="test",
        app_id="ios",
        token=tok,
        payload={"aps": {"alert": "hi"}},
        apns=ApnsOptions(),
    )


@pytest.fixture
async def sim() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as simulator:
        yield simulator


@pytest.fixture
async def make_client(sim: ApnsSimulator, tmp_path: Path) -> AsyncIterator[MakeClient]:
    async with started_clients(sim, tmp_path, request_timeout=10.0, max_connections=1) as make:
        yield make


async def first_connection(client: ApnsClient) -> _ApnsProtocol:
    """The connection a first push opened (the server's SETTINGS known by then)."""
    assert (await client.send(push_for(token()))).outcome is Outcome.OK
    assert client._pool is not None
    (protocol,) = client._pool.connections
    assert isinstance(protocol, _ApnsProtocol)
    return protocol


def answered(sim: ApnsSimulator) -> Counter[str]:
    """Per token, the requests the simulator processed and answered (deliveries)."""
    return Counter(r.token for r in sim.requests if r.fault is None and r.status == 200)


# --- GOAWAY with a last-stream-id below requests in flight ------------------------------


async def test_goaway_resends_only_the_streams_above_its_last_stream_id(
    sim: ApnsSimulator, make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Apple's graceful GOAWAY names the last stream it will process. Every request in
    flight failed `connection_error` at once, the processed ones too: their retries
    delivered them twice, and a GOAWAY on a busy connection (more requests in flight than
    the breaker's threshold) opened the lane's circuit breaker. Now the requests above
    the last stream go out again on a new connection, once, and the others get their own
    answers on the old one."""
    caplog.set_level(logging.INFO)
    client = await make_client()
    protocol = await first_connection(client)
    tokens = [token() for _ in range(6)]
    for tok in tokens:
        # answered a moment after the GOAWAY (sent as soon as all six have arrived)
        sim.script(tok, ApnsResponse.ok(delay=1.0))
    sending = asyncio.gather(*(client.send(push_for(t)) for t in tokens))
    arrived = await sim.wait_for_requests(1 + len(tokens))
    stream_of = {r.token: r.stream_id for r in arrived[1:]}
    last = sorted(stream_of.values())[2]  # three processed, three not
    sim.goaway_all("Shutdown", last_stream_id=last)
    attempts = await asyncio.wait_for(sending, 30)

    assert [a.outcome for a in attempts] == [Outcome.OK] * len(tokens)
    delivered = answered(sim)
    assert all(delivered[t] == 1 for t in tokens), delivered  # none lost, none twice
    for tok in tokens:
        conns = [r.connection_id for r in sim.requests_for(tok)]
        if stream_of[tok] <= last:  # processed: answered there, never sent again
            assert conns == [protocol_id(sim, tok)]
        else:  # not processed: once more, on a new connection
            assert len(conns) == 2 and conns[0] != conns[1]
    assert sim.connections_opened == 2
    assert protocol.transport is None or protocol.transport.is_closing()
    assert "GOAWAY" in caplog.text and "Shutdown" in caplog.text
    assert not any(t in caplog.text for t in tokens)


def protocol_id(sim: ApnsSimulator, tok: str) -> int:
    return sim.requests_for(tok)[0].connection_id


# --- RST_STREAM -----------------------------------------------------------------------


async def test_a_refused_stream_is_sent_again_at_once(
    sim: ApnsSimulator, make_client: MakeClient
) -> None:
    """RST_STREAM REFUSED_STREAM says the server did not process the request (RFC 9113
    section 8.7): it is sent again at once, not ended `transient` (a push with no retry
    left, SimpleX's after its one, failed although nothing had reached Apple)."""
    client = await make_client()
    await first_connection(client)
    tok = token()
    sim.script(
        tok, ApnsResponse.faulty("reset", error_code=ErrorCodes.REFUSED_STREAM), ApnsResponse.ok()
    )
    attempt = await asyncio.wait_for(client.send(push_for(tok)), 30)
    assert attempt.outcome is Outcome.OK
    assert [r.fault for r in sim.requests_for(tok)] == ["reset", None]


@pytest.mark.parametrize("code", [ErrorCodes.INTERNAL_ERROR, ErrorCodes.CANCEL])
async def test_a_stream_reset_otherwise_is_transient_and_named(
    sim: ApnsSimulator, make_client: MakeClient, code: ErrorCodes
) -> None:
    """A reset that may come after the request was processed is not sent again by the
    client (the dispatcher's retry policy decides); the detail names the code."""
    client = await make_client()
    await first_connection(client)
    tok = token()
    sim.script(tok, ApnsResponse.faulty("reset", error_code=code), ApnsResponse.ok())
    attempt = await asyncio.wait_for(client.send(push_for(tok)), 30)
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail is not None and code.name in attempt.detail
    assert len(sim.requests_for(tok)) == 1


# --- a server that stops answering --------------------------------------------------------


async def test_a_connection_that_stops_answering_is_noticed_dead_and_left(
    sim: ApnsSimulator, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection whose server stopped answering (hung, or a middlebox dropping
    everything) stayed in the pool for good: each push timed out on it, its retries
    too, until TCP gave up a quarter of an hour later. A timed-out request now sends a
    PING; unanswered, the connection is closed and the next push opens a new one."""
    monkeypatch.setattr(_ApnsProtocol, "PING_TIMEOUT", 0.5, raising=False)
    client = await make_client(request_timeout=0.5)
    protocol = await first_connection(client)
    lost = asyncio.get_running_loop().create_future()
    real_lost = protocol.connection_lost

    def on_lost(exc: Exception | None) -> None:
        real_lost(exc)
        lost.set_result(None)

    protocol.connection_lost = on_lost  # type: ignore[method-assign]
    sim.stall_all()
    attempt = await client.send(push_for(token()))
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.TIMEOUT)
    await asyncio.wait_for(lost, 10)  # noticed dead: no PING answer
    assert client._pool is not None and protocol not in client._pool.connections
    assert (await client.send(push_for(token()))).outcome is Outcome.OK
    assert sim.connections_opened == 2


async def test_a_slow_answer_on_a_live_connection_keeps_it(
    sim: ApnsSimulator, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PING after a timeout is answered by a live server: one slow answer does not
    cost the connection and the requests in flight on it."""
    monkeypatch.setattr(_ApnsProtocol, "PING_TIMEOUT", 5.0, raising=False)
    client = await make_client(request_timeout=0.3)
    protocol = await first_connection(client)
    slow = token()
    sim.script(slow, ApnsResponse.ok(delay=60))
    attempt = await client.send(push_for(slow))
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.TIMEOUT)

    async def ping_answered() -> None:
        while protocol._ping_sent is not None:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(ping_answered(), 5)
    assert (await client.send(push_for(token()))).outcome is Outcome.OK
    assert client._pool is not None and client._pool.connections == [protocol]
    assert sim.connections_opened == 1
