"""GatewayHarness, as docs/plugins.md shows it to plugin authors."""

from __future__ import annotations

import asyncio
import gc
import warnings
from pathlib import Path
from typing import Any

import pytest

from gateway.api import PluginContext, hookimpl
from gateway.testing import GatewayHarness, base_config


class _FailingService:
    """A plugin service whose start fails, as a plugin under test may."""

    name = "failing"

    def __init__(self) -> None:
        self.stopped = False

    async def start(self) -> None:
        raise RuntimeError("relay unreachable")

    async def stop(self) -> None:
        self.stopped = True

    def ready(self) -> bool:
        return False


class _FailingPlugin:
    @hookimpl
    def pushgw_services(self, context: PluginContext) -> list[Any]:
        return [_FailingService()]


async def test_a_start_up_failure_leaves_nothing_running(tmp_path: Path) -> None:
    """When a plugin's start-up fails, `async with GatewayHarness(...)` raises that
    error and leaves nothing behind: aiohttp leaves the contexts that had started
    (store, receipts writer, dispatcher, metrics flusher) running when a later one
    fails, and the test client's session open, unless the harness cleans them up."""
    before = asyncio.all_tasks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(RuntimeError, match="relay unreachable"):
            async with GatewayHarness(
                base_config(tmp_path, {}), extra_plugins={"failing": _FailingPlugin()}
            ):
                pass  # pragma: no cover - start-up fails
        gc.collect()  # an unclosed aiohttp ClientSession warns when collected
    left = {task.get_name() for task in asyncio.all_tasks() - before if not task.done()}
    assert left == set()
    assert not [w for w in caught if "Unclosed" in str(w.message)]


class _RecordingService(_FailingService):
    """A service that starts: it must be stopped when a later one fails to start."""

    name = "recording"

    async def start(self) -> None:
        return None


async def test_services_started_before_a_failing_one_are_stopped(tmp_path: Path) -> None:
    started_first = _RecordingService()

    class Plugin:
        @hookimpl
        def pushgw_services(self, context: PluginContext) -> list[Any]:
            return [started_first, _FailingService()]

    with pytest.raises(RuntimeError, match="relay unreachable"):
        async with GatewayHarness(base_config(tmp_path, {}), extra_plugins={"two": Plugin()}):
            pass  # pragma: no cover - start-up fails
    assert started_first.stopped
