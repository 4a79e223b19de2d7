"""Review (asyncio hygiene): a gateway started and stopped several times in one process
(as a test suite, `GatewayHarness` users and embedding applications do) leaves nothing
behind: no file descriptor, task or thread, no ResourceWarning, and no memory.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from gateway.testing.relay import NostrRelayProcess, relay_available
from plugins.marmot.keys import ServerKey
from tests.marmot.gw import marmot_section
from tests.marmot.helpers import V_MARMOT, apns_device, chunk_for, content_of, publish, sdk_wrap
from tests.matrix.conftest import NOTIFY, apns_pushkey, device, fcm_pushkey, notification
from tests.zulip.conftest import ZulipServer, apns_token, zulip_config

CYCLES = 3


def _open_fds() -> set[str]:
    """What this process's descriptors point at: a socket's inode is never reused while
    the socket is open, so a socket opened since and left open is a new entry."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed meanwhile
            continue
    return found


@contextmanager
def _gc_threshold_kept() -> Iterator[None]:
    """The harness tunes the collector (`tune_gc`); the rest of the session gets it back."""
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*before)


class _Probe:
    """An object in a reference cycle: only the cyclic collector can reclaim it."""

    def __init__(self) -> None:
        self.me = self


def _matrix_section(apns: ApnsSimulator, fcm: FcmSimulator, directory: Path) -> dict[str, Any]:
    return {
        "apps": {
            "com.example.ios": apns_app_config(apns, directory),
            "com.example.android": fcm_app_config(fcm, directory),
        },
        "notify_deadline": 3.0,
    }


async def test_objects_alive_at_a_gateways_start_are_collected_after_it_stopped(
    tmp_path: Path,
) -> None:
    """Start-up freezes what is alive (`gc.freeze`, to keep full collections short);
    frozen objects are never collected, so every gateway a process had stopped, and
    everything else alive when it started, stayed in memory for good."""
    with _gc_threshold_kept():
        async with ApnsSimulator() as apns, FcmSimulator() as fcm:
            probe = _Probe()
            gone = weakref.ref(probe)
            config = base_config(tmp_path, {"matrix": _matrix_section(apns, fcm, tmp_path)})
            async with GatewayHarness(config) as gw:
                body = notification([device("com.example.ios", apns_pushkey()[0])])
                response = await gw.client.post(NOTIFY, json=body)
                assert response.status == 200
            del probe
            gc.collect()
            assert gone() is None
            assert gc.get_freeze_count() == 0


async def _traffic(
    gw: GatewayHarness,
    apns: ApnsSimulator,
    relay: NostrRelayProcess | None,
    key: ServerKey,
) -> None:
    """A push through each plugin: Matrix notify, Zulip legacy notify, a Marmot trigger."""
    sent = apns.request_count
    body = notification(
        [device("com.example.ios", apns_pushkey()[0]), device("com.example.android", fcm_pushkey())]
    )
    response = await gw.client.post(NOTIFY, json=body)
    assert (response.status, await response.json()) == (200, {"rejected": []})

    server = ZulipServer(gw.client)
    await server.register()
    status, _ = await server.legacy_register(apns_token(), 1, user_id=1)
    assert status == 200
    status, answer = await server.json(
        "push/notify",
        {
            "user_id": 1,
            "apns_payload": {"alert": {"title": "t"}},
            "gcm_payload": {"event": "message"},
            "gcm_options": {},
        },
    )
    assert (status, answer["total_apple_devices"]) == (200, 1)
    expected = sent + 2

    if relay is not None:
        service = gw.context("marmot").state["service"]
        await service.wait_live(20)
        wrap = sdk_wrap(key, content_of([chunk_for(key, apns_device())]), [V_MARMOT])
        assert await publish(relay.url, wrap) == ""
        expected += 1
        await apns.wait_for_requests(expected, 20)
        await service.idle()
    await apns.wait_for_requests(expected)
    assert (await gw.client.get("/metrics")).status == 200


async def _cycle(
    directory: Path,
    apns: ApnsSimulator,
    fcm: FcmSimulator,
    relay: NostrRelayProcess | None,
) -> None:
    directory.mkdir()
    plugins: dict[str, Any] = {
        "matrix": _matrix_section(apns, fcm, directory),
        "zulip": zulip_config(apns, fcm, directory)["plugins"]["zulip"],
    }
    key = ServerKey.generate()
    if relay is not None:
        plugins["marmot"] = marmot_section(directory, key, [relay.url], apns, fcm)
    async with GatewayHarness(base_config(directory, plugins)) as gw:
        await _traffic(gw, apns, relay, key)


@pytest.mark.slow
async def test_start_traffic_stop_cycles_leave_nothing_behind(tmp_path: Path) -> None:
    """Every plugin's traffic, then stop, several times in one process: the file
    descriptors, tasks and threads are those before the first cycle, and nothing
    warned of an unclosed socket, transport, file or session."""
    relay = NostrRelayProcess(tmp_path / "relay") if relay_available() else None
    if relay is not None:
        relay.start()
    try:
        with _gc_threshold_kept(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            async with ApnsSimulator() as apns, FcmSimulator() as fcm:
                # Lazy process-wide pieces (imports, asyncio's default executor) come
                # with the first gateway; they are not what a cycle leaves.
                await _cycle(tmp_path / "warm-up", apns, fcm, relay)
                gc.collect()
                tasks, threads = asyncio.all_tasks(), threading.active_count()
                fds = _open_fds()
                for n in range(CYCLES):
                    await _cycle(tmp_path / f"cycle-{n}", apns, fcm, relay)
                gc.collect()
                assert {t.get_name() for t in asyncio.all_tasks() - tasks if not t.done()} == set()
                assert threading.active_count() <= threads
            # The simulators' connections end with them; the gateways' ended before.
            gc.collect()
            assert _open_fds() - fds == set()
        assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        if relay is not None:
            relay.stop()
