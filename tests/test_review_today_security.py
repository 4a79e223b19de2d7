"""Security review of the day's changes (device gate, shutdown delay, Kubernetes
manifests, `pushgw zulip forget`): found by review, each with a failing test first."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.cli import main
from gateway.config import ServerConfig
from gateway.core.push import Outcome
from gateway.testing.fcm_sim import FcmResponse
from tests import test_review_erasure as erasure
from tests import test_review_google_rules as google
from tests.test_review_k8s import _manifests
from tests.zulip import conftest as zulip_fixtures
from tests.zulip.conftest import Env

rig = google.rig
env = zulip_fixtures.env
sims = zulip_fixtures.sims


# --- the device gate: its keys are device tokens in clear ----------------------------------


async def test_a_lanes_repr_shows_no_throttled_device_token(rig: google.Rig) -> None:
    """The per-device gate keeps each throttled device's token in clear as a key. Lane
    is a dataclass: its repr (a debug line, a crash reporter's captured locals of
    `_attempts`) listed every throttled token of the app, where Push hides its own."""
    rig.fcm.script(google.NOISY, FcmResponse.quota_exceeded(scope="device", retry_delay="30s"))
    receipt = await rig.dispatcher.send(rig.push(google.NOISY, deadline=5.0))
    assert receipt.outcome is Outcome.THROTTLED
    assert google.NOISY in rig.lane.device_gates  # the gate is closed for that device
    assert google.NOISY not in repr(rig.lane)
    assert google.NOISY not in repr(rig.dispatcher._lanes)


# --- server.shutdown_delay: a node half-alive for ever ---------------------------------------


@pytest.mark.parametrize("delay", [float("inf"), 1e9, 3601.0])
def test_a_shutdown_delay_without_end_is_a_config_error(delay: float) -> None:
    """During the delay the node is unready yet serving, and every further stop signal is
    ignored: `shutdown_delay: .inf` (or hours) left it so until a SIGKILL, which loses
    the receipts still in memory. Refused at load, naming the key."""
    with pytest.raises(ValidationError) as caught:
        ServerConfig(shutdown_delay=delay)
    assert "shutdown_delay" in str(caught.value)


def test_a_usual_shutdown_delay_still_loads() -> None:
    assert ServerConfig(shutdown_delay=5.0).shutdown_delay == 5.0
    assert ServerConfig(shutdown_delay=3600).shutdown_delay == 3600.0


# --- docs/kubernetes.md: the example manifests, hardened ------------------------------------


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = _manifests()["StatefulSet"]["spec"]["template"]["spec"]
    return spec


def test_the_example_pod_passes_the_restricted_pod_security_profile() -> None:
    """Copied into a namespace enforcing `restricted`, the StatefulSet's pods were refused:
    the init container (running `db upgrade` with the database password) had no
    securityContext at all (privilege escalation allowed, every default capability), and
    no seccomp profile was set. The Kubernetes API token was mounted for nothing."""
    pod = _pod()
    assert pod.get("automountServiceAccountToken") is False
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] != 0 and context.get("runAsGroup", 0) != 0
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    containers = pod["containers"] + pod.get("initContainers", [])
    assert len(containers) == 2
    for container in containers:
        own = container.get("securityContext", {})
        assert own.get("allowPrivilegeEscalation") is False, container["name"]
        assert own.get("capabilities", {}).get("drop") == ["ALL"], container["name"]
        assert own.get("readOnlyRootFilesystem") is True, container["name"]
        assert not own.get("privileged", False), container["name"]
        assert own.get("runAsUser", 1) != 0, container["name"]


def test_the_example_credentials_are_not_world_readable() -> None:
    """A Secret volume's files are 0644 unless told otherwise: the APNs key, the Firebase
    service account and the receipts HMAC key readable by every user of the container."""
    secrets = [v["secret"] for v in _pod()["volumes"] if "secret" in v]
    assert secrets
    for secret in secrets:
        mode = secret.get("defaultMode", 0o644)
        assert mode & 0o007 == 0, oct(mode)
        for item in secret.get("items", []):
            assert item.get("mode", mode) & 0o007 == 0


def test_the_example_metrics_port_is_open_to_prometheus_only() -> None:
    """The Service carried `metrics` next to `http`, and nothing limited who reaches it:
    any pod of the cluster (or anything a LoadBalancer or Ingress exposed the Service
    to) read the gateway's metrics. A NetworkPolicy lets anyone reach `http`, `metrics`
    only from the monitoring namespace."""
    objects = _manifests()
    policy = objects.get("NetworkPolicy")
    assert policy is not None, "no NetworkPolicy in docs/kubernetes.md"
    labels = objects["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    rules = policy["spec"]["ingress"]
    metrics_rules = [
        rule
        for rule in rules
        if not rule.get("ports") or any(p.get("port") == "metrics" for p in rule["ports"])
    ]
    assert metrics_rules
    for rule in metrics_rules:
        sources = rule.get("from")
        assert sources, "a rule opens the metrics port to everyone"
        for source in sources:
            assert "ipBlock" not in source and source.get("namespaceSelector", {}).get(
                "matchLabels"
            ), source
    # the push API stays reachable (the probes and the homeservers)
    assert any(any(p.get("port") == "http" for p in r.get("ports", [])) for r in rules)


# --- pushgw zulip forget: an operator's mistake, said in its words ---------------------------


async def test_forget_with_a_user_id_out_of_range_is_a_usage_error(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--user-id 99999999999999999999` went to the database, whose driver raised:
    `plugin 'zulip': its command 'zulip' raised OverflowError at .../aiosqlite/core.py`,
    status 1, which says nothing of the argument. Now status 2 naming it."""
    server, _realm = await env.ready_server()
    cfg = erasure._write_config(env, env.context.store.url)
    base = ["-c", str(cfg), "zulip", "forget", "--server", server.uuid, "--user-id"]
    assert await asyncio.to_thread(main, [*base, "9" * 23]) == 2
    err = capsys.readouterr().err
    assert "--user-id" in err and "out of range" in err
    assert "OverflowError" not in err
    assert await asyncio.to_thread(main, [*base, str(-(2**63))]) == 0  # int64's least: fine
    assert capsys.readouterr().out == "deleted 0 E2EE and 0 legacy registrations\n"
