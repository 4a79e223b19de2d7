"""Gateway set-up shared by the Marmot integration tests: simulators + harness + marmot config."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from plugins.marmot.keys import ServerKey
from plugins.marmot.service import MarmotService

APNS_TOPIC = "org.example.whitenoise"


@dataclass
class MarmotGateway:
    harness: GatewayHarness
    apns: ApnsSimulator
    fcm: FcmSimulator
    key: ServerKey
    directory: Path

    @property
    def service(self) -> MarmotService:
        service = self.harness.context("marmot").state["service"]
        assert isinstance(service, MarmotService)
        return service

    def metric(self, name: str, **labels: str) -> float:
        registry = self.harness.context("marmot").metrics.registry
        value = registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)


def marmot_section(
    directory: Path,
    key: ServerKey,
    relays: Sequence[str],
    apns: ApnsSimulator,
    fcm: FcmSimulator,
    /,
    **extra: Any,
) -> dict[str, Any]:
    # Positional-only: `apns`/`fcm` in **extra are the config sections, not the simulators.
    keyfile = directory / "marmot-server.key"
    keyfile.write_text(key.secret.hex() + "\n")
    section: dict[str, Any] = {
        "server_secret_key_file": str(keyfile),
        "inbox_relays": list(relays),
        "apps": {
            "ios": apns_app_config(apns, directory, topic=APNS_TOPIC),
            "android": fcm_app_config(fcm, directory),
        },
        "apns": {"app": "ios"},
        "fcm": {"app": "android"},
        "backoff_min": 0.2,
        "backoff_max": 1.0,
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(section.get(k), dict):
            section[k] = {**section[k], **v}
        else:
            section[k] = v
    return section


@contextlib.asynccontextmanager
async def marmot_gateway(
    directory: Path,
    relays: Sequence[str],
    *,
    key: ServerKey | None = None,
    wait_live: bool = True,
    **extra: Any,
) -> AsyncIterator[MarmotGateway]:
    key = key or ServerKey.generate()
    directory.mkdir(parents=True, exist_ok=True)
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        section = marmot_section(directory, key, relays, apns, fcm, **extra)
        async with GatewayHarness(base_config(directory, {"marmot": section})) as harness:
            gw = MarmotGateway(harness, apns, fcm, key, directory)
            if wait_live:
                await gw.service.wait_live(20)
            yield gw
