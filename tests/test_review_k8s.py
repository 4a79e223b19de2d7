"""Running pushgw on Kubernetes (replicas behind a Service, probes, rolling updates):
found by review, each with a failing test first. No sleeps stand in for
synchronisation: the tests wait on the gateway's own lines or its exit."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway import serve as serve_module
from gateway.app import CORE_ROUTES, load_gateway
from gateway.cli import build_parser, cmd_db_upgrade, cmd_serve
from gateway.core.store import PING_TIMEOUT
from gateway.serve import STOP_GRACE
from gateway.testing.apns_sim import ApnsSimulator, generate_apns_auth_key
from gateway.testing.fcm_sim import make_service_account
from gateway.testing.harness import apns_app_config
from tests.serve_process import finish, free_port, kill_group, read_until, running_pids, spawn_serve

ROOT = Path(__file__).resolve().parents[1]
PUSHKEY = "ef" * 32


def _config(tmp_path: Path, apns: ApnsSimulator, port: int, **server: object) -> Path:
    app = apns_app_config(apns, tmp_path, topic="com.example.ios")
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"host": "127.0.0.1", "port": port, "shutdown_timeout": 5.0, **server},
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {"directory": str(tmp_path / "receipts"), "hmac_key": "k"},
                "plugins": {"enabled": ["matrix"], "matrix": {"apps": {"com.example.ios": app}}},
            }
        )
    )
    return config


async def _spawn(config: Path) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PUSHGW_CONFIG", None)
    return await spawn_serve(config, env)


async def _notify(session: aiohttp.ClientSession, port: int, n: int) -> int:
    body = {
        "notification": {
            "event_id": f"$event{n}",
            "room_id": "!room:example.org",
            "counts": {"unread": 1},
            "devices": [{"app_id": "com.example.ios", "pushkey": PUSHKEY}],
        }
    }
    url = f"http://127.0.0.1:{port}/_matrix/push/v1/notify"
    async with session.post(url, json=body) as response:
        return response.status


# --- SIGTERM: unready first, still serving, then the drain -----------------------------


@pytest.mark.parametrize("workers", [1, 2])
async def test_after_sigterm_readyz_is_503_while_the_gateway_still_serves(
    tmp_path: Path, workers: int
) -> None:
    """Kubernetes sends SIGTERM while the Service's endpoints (kube-proxy, ingress
    controllers) still route new connections to the pod for a few seconds. The gateway
    closed its listener at once: those connections were refused, and the homeservers'
    pushes failed during every rolling update. With `server.shutdown_delay` it serves on
    that long after the signal, /readyz answering 503 (`stopping`) and every answer
    closing its connection (keep-alive clients reconnect elsewhere), then drains."""
    async with ApnsSimulator() as apns:
        port = free_port()
        config = _config(tmp_path, apns, port, workers=workers, shutdown_delay=600)
        proc = await _spawn(config)
        seen: list[str] = []
        try:
            await running_pids(proc, seen, workers)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                    assert response.status == 200, await response.text()
                proc.send_signal(signal.SIGTERM)
                # Counted in the text, not by line: two workers' lines written at the
                # same moment may share one.
                while "".join(seen).count("/readyz answers 503") < workers:
                    await read_until(proc, seen, r"/readyz answers 503")
                async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                    body = await response.json()
                    assert response.status == 503, body
                    assert body["stopping"] is True and body["ready"] is False, body
                    assert response.headers.get("Connection", "").lower() == "close"
                async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                    assert response.status == 200  # alive: no restart for stopping
                assert await _notify(session, port, 1) == 200  # a new connection: served
        finally:
            kill_group(proc)
            await proc.wait()
    assert "Traceback" not in "".join(seen)


async def test_after_the_shutdown_delay_the_gateway_drains_and_exits_cleanly(
    tmp_path: Path,
) -> None:
    """The delay ends in the usual graceful stop: exit status 0, receipts published."""
    async with ApnsSimulator() as apns:
        port = free_port()
        proc = await _spawn(_config(tmp_path, apns, port, shutdown_delay=0.2))
        seen: list[str] = []
        try:
            await running_pids(proc, seen, 1)
            async with aiohttp.ClientSession() as session:
                assert await _notify(session, port, 0) == 200
            proc.send_signal(signal.SIGTERM)
            status = await finish(proc, seen)
        finally:
            kill_group(proc)
            await proc.wait()
    stderr = "".join(seen)
    assert status == 0, stderr
    assert "server.shutdown_delay" in stderr
    assert "Traceback" not in stderr
    assert list((tmp_path / "receipts").glob("*.parquet")), stderr


# --- docs/kubernetes.md: the example manifests, checked against the product ---------------

K8S_DOC = ROOT / "docs" / "kubernetes.md"


def _manifests() -> dict[str, dict[str, Any]]:
    """Every object of the doc's YAML blocks, by kind (one of each)."""
    blocks = re.findall(r"```yaml\n(.*?)```", K8S_DOC.read_text(), flags=re.S)
    assert blocks, "docs/kubernetes.md has no manifests"
    found: dict[str, dict[str, Any]] = {}
    for block in blocks:
        for doc in yaml.safe_load_all(block):
            if doc:
                key = (
                    doc["kind"]
                    if doc["kind"] not in found
                    else f"{doc['kind']}/{doc['metadata']['name']}"
                )
                found[key] = doc
    return found


def _container_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's literal environment, `$(VAR)` expanded as the kubelet does;
    values from Secrets stand in as a PostgreSQL URL (the only one the doc takes so)."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env[m.group(1)], str(item["value"])
            )
        elif "fieldRef" in item.get("valueFrom", {}):
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = pod_name
        else:
            env[item["name"]] = "postgresql+asyncpg://pushgw:pw@db.example:5432/pushgw"
    return env


def test_kubernetes_manifests_match_the_product(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A platform engineer copies these: every port, path, command and deadline in them
    must be what the gateway really uses, and the configuration must load."""
    objects = _manifests()
    config_map, workload = objects["ConfigMap"], objects["StatefulSet"]
    service, monitor = objects["Service"], objects["ServiceMonitor"]
    pod = workload["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    (init,) = pod["initContainers"]
    env = _container_env(main, "pushgw-0")
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    # Secrets: every *_file of the configuration inside the mounted Secret.
    text = config_map["data"][Path(env["PUSHGW_CONFIG"]).name]
    secret_mount = next(m for m in mounts.values() if volumes[m["name"]].get("secret"))
    secret = objects["Secret"]
    assert volumes[secret_mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
    files = re.findall(r"(?:_file|keyfile): (\S+)", text)
    assert files
    for file in files:
        assert Path(file).parent == Path(secret_mount["mountPath"]), file
        assert Path(file).name in secret["stringData"], file
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    for name in secret["stringData"]:  # real credentials: the gateway loads each
        if name.endswith(".p8"):
            generate_apns_auth_key().write_p8(secrets_dir / name)
        elif name.endswith(".json"):
            make_service_account("pushgw-k8s", "https://oauth2.example/token", secrets_dir / name)
        else:
            (secrets_dir / name).write_text("ab" * 32 + "\n")

    # The configuration the pod reads: the ConfigMap's file, at the path PUSHGW_CONFIG
    # names (its secrets here in `secrets_dir`), with the pod's PUSHGW__ variables.
    config_mount = next(m for m in mounts.values() if volumes[m["name"]].get("configMap"))
    assert "subPath" not in config_mount
    config_path = Path(env["PUSHGW_CONFIG"])
    assert config_path.parent == Path(config_mount["mountPath"])
    here = tmp_path / config_path.name
    here.write_text(text.replace(secret_mount["mountPath"], str(secrets_dir)))
    for name in list(os.environ):
        if name.startswith("PUSHGW_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("PUSHGW__"):
            monkeypatch.setenv(name, value)
    settings = load_gateway(here).settings  # every section, plugins and credentials too
    server = settings.server

    # Commands: what `pushgw` parses, migrations in the init container, no auto-upgrade.
    parser = build_parser()
    assert main["command"] == init["command"] == ["pushgw"]
    assert parser.parse_args(main["args"]).handler is cmd_serve
    assert parser.parse_args(init["args"]).handler is cmd_db_upgrade
    assert init["env"] == main["env"] and init["volumeMounts"] == main["volumeMounts"]
    assert settings.store.auto_upgrade is False
    assert settings.store.url.startswith("postgresql+asyncpg://")

    # Ports and probes.
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert server.host == "0.0.0.0"
    assert ports == {"http": server.port, "metrics": server.metrics_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = main[probe]["httpGet"]
        assert get["port"] == "http" and get["path"] in CORE_ROUTES, probe
    # Liveness must not depend on the database or providers: /healthz, never /readyz.
    assert main["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert main["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert main["readinessProbe"]["timeoutSeconds"] > PING_TIMEOUT

    # Stopping: unready first, then the drain, all within the grace period.
    assert server.shutdown_delay > 0
    assert "preStop" not in main.get("lifecycle", {})
    longest = server.shutdown_delay + 2 * server.shutdown_timeout + STOP_GRACE
    assert pod["terminationGracePeriodSeconds"] >= longest

    # Receipts: a directory per pod, on the mounted volume; a writable TMPDIR.
    receipts = settings.receipts.directory
    assert Path(receipts).name == "pushgw-0"
    assert any(Path(receipts).parent == Path(m["mountPath"]) for m in mounts.values())
    assert any(Path(env["TMPDIR"]) == Path(m["mountPath"]) for m in mounts.values())

    # Service and ServiceMonitor: the right pods, ports by name, /metrics.
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert set(targets.values()) <= set(ports)
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert targets[endpoint["port"]] == "metrics" and endpoint["path"] == "/metrics"


# --- the workers' own lines: one write each ------------------------------------------------


class _Writes(io.StringIO):
    """A stderr that records each write() call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_a_serve_line_is_one_write_with_its_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pushgw serve --workers N` has every worker say `Running on ...`, and on SIGTERM
    with `server.shutdown_delay` that it is stopping, at the same moment, on the one
    stderr the pod's log collector reads. Each line was written as two writes (the text,
    then the newline), so two workers' lines ran together into one log record. Now
    each line is one write, newline included (a pipe write of that size is atomic)."""
    stderr = _Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    serve_module._tell("pushgw 42 (asyncio loop): ======== Running on http://0.0.0.0:5000 ========")
    assert stderr.calls == [
        "pushgw 42 (asyncio loop): ======== Running on http://0.0.0.0:5000 ========\n"
    ]
