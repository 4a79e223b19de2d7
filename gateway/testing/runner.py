"""Start both provider simulators for `pushgw simulate`, demos and benchmarks."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.testing.apns_sim import ApnsSimulator, generate_apns_auth_key
from gateway.testing.certs import SimulatorCA
from gateway.testing.fcm_sim import FcmSimulator, make_service_account

__all__ = ["SimulatorInfo", "serve_simulators"]

#: Name of the JSON file `serve_simulators` writes into `state_dir`.
INFO_FILE = "simulators.json"


@dataclass
class SimulatorInfo:
    """Where the running simulators are and the files a gateway needs to reach them.

    `apns_server_name` is the TLS/SNI name to keep while connecting to
    `apns_host:apns_port`. The APNs simulator checks JWTs signed with the key in
    `apns_key_path` (`apns_key_id`, `apns_team_id`) when `verify_jwt` was on.
    `as_dict()` is what `simulators.json` in `state_dir` contains.
    """

    apns_host: str
    apns_port: int
    apns_url: str
    apns_server_name: str
    ca_path: Path
    apns_key_path: Path
    apns_key_id: str
    apns_team_id: str
    fcm_url: str
    fcm_send_url_template: str
    token_uri: str
    service_account_path: Path
    project_id: str
    state_dir: Path
    apns: ApnsSimulator = field(repr=False)
    fcm: FcmSimulator = field(repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready description (paths as strings, without the simulator objects)."""
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if name in ("apns", "fcm"):
                continue
            out[name] = str(value) if isinstance(value, Path) else value
        return out

    async def stop(self) -> None:
        """Stop both simulators (files in `state_dir` are left in place)."""
        await self.apns.stop()
        await self.fcm.stop()


async def serve_simulators(
    host: str = "127.0.0.1",
    apns_port: int = 0,
    fcm_port: int = 0,
    state_dir: str | Path | None = None,
    *,
    project_id: str = "pushgw-sim",
    verify_jwt: bool = True,
    max_concurrent_streams: int = 1000,
    record: bool = False,
) -> SimulatorInfo:
    """Start the APNs and FCM simulators in the running loop and write their state files.

    Into `state_dir` (default: a new temporary directory) go the CA PEM
    (`simulator-ca.pem`), an APNs auth key (`AuthKey_<kid>.p8`), a service
    account for `project_id` whose `token_uri` is the FCM simulator
    (`fcm-service-account.json`) and `simulators.json` describing everything.
    `record=False` (the default here) keeps memory flat under long benchmarks.
    Call `await info.stop()` to shut both down.
    """
    directory = (
        Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="pushgw-sim-"))
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca = SimulatorCA(directory)
    key = generate_apns_auth_key()
    key_path = key.write_p8(directory / f"AuthKey_{key.key_id}.p8")
    apns = ApnsSimulator(
        ca=ca,
        max_concurrent_streams=max_concurrent_streams,
        jwt_keys={key.key_id: (key.team_id, key)} if verify_jwt else None,
        record=record,
    )
    fcm = FcmSimulator(record=record)
    await apns.start(host, apns_port)
    try:
        await fcm.start(host, fcm_port)
    except BaseException:
        await apns.stop()
        raise
    account_path = directory / "fcm-service-account.json"
    account = make_service_account(project_id, fcm.token_uri, account_path)
    fcm.add_service_account(account)
    info = SimulatorInfo(
        apns_host=apns.host,
        apns_port=apns.port,
        apns_url=apns.url,
        apns_server_name="api.sandbox.push.apple.com",
        ca_path=ca.ca_path,
        apns_key_path=key_path,
        apns_key_id=key.key_id,
        apns_team_id=key.team_id,
        fcm_url=fcm.url,
        fcm_send_url_template=fcm.send_url_template,
        token_uri=fcm.token_uri,
        service_account_path=account_path,
        project_id=project_id,
        state_dir=directory,
        apns=apns,
        fcm=fcm,
    )
    (directory / INFO_FILE).write_text(json.dumps(info.as_dict(), indent=2))
    return info
