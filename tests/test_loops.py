"""`server.event_loop`: which loop `pushgw serve` runs on."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from gateway.config import ServerConfig
from gateway.loops import loop_factory, run, uses_uvloop

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


def test_asyncio_choice_is_the_standard_loop() -> None:
    loop = loop_factory("asyncio")()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop does not build on this platform")
def test_auto_takes_uvloop_where_installed() -> None:
    assert uses_uvloop("auto")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_module(), "auto").startswith("uvloop")
    assert run(loop_module(), "asyncio").startswith("asyncio")


def test_uvloop_asked_for_but_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    with pytest.raises(ValueError, match="uvloop is not installed"):
        ServerConfig(event_loop="uvloop")
    assert ServerConfig(event_loop="auto").event_loop == "auto"
    assert not uses_uvloop("auto")
