"""`pushgw simulate`: both provider simulators in their own process, until stopped.

Besides what `serve_simulators` writes, it registers a fixed local APNs key
(`apns-auth-key.p8`, key id `SIMKEY0001`, team `SIMTEAM001`) so that
`config/local.yaml` can name stable paths. When the `nostr-relay` command is
installed (the `relay` extra), it also runs a real Nostr relay on
ws://127.0.0.1:6969 and keeps a local server key (`marmot-server.key`) for the
Marmot plugin. It writes `ready.json` last: a gateway started with
`--with-simulators` waits for that file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import sys
from pathlib import Path

from gateway.loops import run, tune_gc
from gateway.preflight import PreflightError, check_state_dir, os_reason, resolve
from gateway.testing.apns_sim import ApnsResponse, generate_apns_auth_key
from gateway.testing.fcm_sim import FcmResponse
from gateway.testing.relay import NostrRelayProcess, relay_available
from gateway.testing.runner import serve_simulators

LOCAL_KEY_ID = "SIMKEY0001"
LOCAL_TEAM_ID = "SIMTEAM001"
LOCAL_KEY_FILE = "apns-auth-key.p8"
READY_FILE = "ready.json"
RELAY_PORT = 6969
NOSTR_KEY_FILE = "marmot-server.key"


def _nostr_key(state_dir: Path) -> Path:
    """A secp256k1 secret for local runs, kept across restarts (0600)."""
    path = state_dir / NOSTR_KEY_FILE
    if not path.exists():
        # 32 random bytes are a valid secp256k1 secret but with probability ~2^-128
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
    return path


async def _main(
    host: str, apns_port: int, fcm_port: int, state_dir: Path, delay: float = 0.0
) -> None:
    ready = state_dir / READY_FILE
    ready.unlink(missing_ok=True)
    info = await serve_simulators(host, apns_port, fcm_port, state_dir)
    if delay:  # every answer late: a slow provider, for load and memory measurements
        info.apns.script_all(ApnsResponse.ok(delay=delay))
        info.fcm.script_all(FcmResponse.ok(delay=delay))
    key = generate_apns_auth_key(LOCAL_KEY_ID, LOCAL_TEAM_ID)
    key_path = key.write_p8(state_dir / LOCAL_KEY_FILE)
    info.apns.add_jwt_key(key.key_id, key.team_id, key)
    description = {
        **info.as_dict(),
        "local_key_path": str(key_path),
        "local_key_id": LOCAL_KEY_ID,
        "local_team_id": LOCAL_TEAM_ID,
    }
    relay = None
    if relay_available():
        relay = NostrRelayProcess(state_dir / "relay", port=RELAY_PORT)
        await asyncio.to_thread(relay.start)
        description["relay_url"] = relay.url
        description["nostr_key_path"] = str(_nostr_key(state_dir))
    tune_gc()  # as the gateway: they share the host's cores in benchmarks
    ready.write_text(json.dumps(description, indent=2))
    print(f"APNs simulator: {info.apns_url} (HTTP/2 + TLS, CA {info.ca_path})", flush=True)
    print(f"FCM simulator:  {info.fcm_url} (OAuth {info.token_uri})", flush=True)
    print(f"service account: {info.service_account_path}; APNs key: {key_path}", flush=True)
    if relay is not None:
        print(f"Nostr relay:    {relay.url} (nostr-relay, storage {relay.db})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await info.stop()
        if relay is not None:
            relay.stop()
        ready.unlink(missing_ok=True)


def run_simulators(
    host: str, apns_port: int, fcm_port: int, state_dir: Path, delay: float = 0.0
) -> int:
    """Run the simulators until SIGINT or SIGTERM; the exit status of `pushgw simulate`.

    A bad argument (a state directory that is not one or cannot be made or written
    into, a host that does not resolve or is no host name) or a port that cannot be
    listened on is one line on stderr and status 2, as `pushgw serve` reports them.
    """
    try:
        check_state_dir(state_dir)
    except PreflightError as exc:
        return _usage_error(f"--state-dir {state_dir}: {exc}")
    try:
        resolve(host, apns_port)  # as the simulators' sites will, before they start
    except PreflightError as exc:
        return _usage_error(f"--host {host}: {exc}")
    try:
        # uvloop where installed, as `pushgw serve`: the simulators share the host's
        # cores with the gateway in local runs and benchmarks
        run(_main(host, apns_port, fcm_port, state_dir, delay))
    except OSError as exc:
        return _usage_error(f"cannot start the simulators: {os_reason(exc)}")
    return 0


def _usage_error(message: str) -> int:
    print(f"pushgw: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m gateway.testing.standalone")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--apns-port", type=int, default=2197)
    parser.add_argument("--fcm-port", type=int, default=4080)
    parser.add_argument("--state-dir", default="var/simulators")
    parser.add_argument("--delay", type=float, default=0.0, help="answer every request late")
    a = parser.parse_args()
    sys.exit(run_simulators(a.host, a.apns_port, a.fcm_port, Path(a.state_dir), a.delay))
