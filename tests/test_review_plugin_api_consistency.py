"""Plugins use the core's knowledge through `gateway.api`, not copies of it that drift.

Each test here fails if a plugin's view and the core's part again.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.api import CONFIG_REASONS, GATEWAY_REASONS, Metrics, Outcome, apns_payload_problem
from gateway.core import apns as apns_core
from plugins.marmot.config import MarmotConfig
from plugins.marmot.keys import ServerKey
from tests.marmot.helpers import apns_device, chunk_for, fcm_device
from tests.marmot.test_config_limits import section
from tests.marmot.test_service import Clock, Harness, trigger

# --- Marmot's configuration errors are (at least) the core's ---------------------------------


# A status other than 403 for each (Marmot counts every 403 anyway): what the provider sends
# with it, or none for the gateway's own reasons.
_STATUS = {"NOT_FOUND": 404, "APNS_AUTH_ERROR": 401, "THIRD_PARTY_AUTH_ERROR": 401}


async def _config_errors(reason: str, status: int | None, *, fcm: bool) -> Harness:
    key = ServerKey.generate()
    h = Harness(key, Clock())
    h.outcome = lambda p: (Outcome.PERMANENT, reason, status)
    device = fcm_device() if fcm else apns_device()
    await h.run_once(trigger(key, [chunk_for(key, device)]))
    return h


@pytest.mark.parametrize("reason", sorted(CONFIG_REASONS))
async def test_marmot_counts_every_configuration_reason_of_the_core(reason: str) -> None:
    """The core's dispatcher logs these as "the app's configuration is wrong"; Marmot's
    `pushgw_marmot_config_errors_total` (what docs/marmot.md says to alert on) must count
    each of them too, whatever the HTTP status. Marmot kept its own list: an FCM app of the
    wrong project (404 `NOT_FOUND`) or whose APNs key Firebase refuses (`APNS_AUTH_ERROR`,
    a 401) was counted as nothing but a failed push."""
    status = _STATUS.get(reason, None if reason in GATEWAY_REASONS else 400)
    h = await _config_errors(reason, status, fcm=reason.isupper())
    assert h.sample("pushgw_marmot_config_errors_total", reason=reason) == 1
    platform = "fcm" if reason.isupper() else "apns"
    assert h.sample("pushgw_marmot_dead_tokens_total", platform=platform) == 0


def test_every_configuration_reason_is_its_own_metric_label() -> None:
    """A configuration reason the core adds is labelled by itself, not folded into `other`
    (or the status): the on-call must see which one it is."""
    assert {r for r in CONFIG_REASONS if Metrics.reason_label(r) != r} == set()


async def test_a_token_the_core_calls_dead_is_a_dead_token_for_marmot() -> None:
    """Marmot counts dead tokens by the core's outcome, not by its own list of names: an
    FCM `INVALID_ARGUMENT` naming the token (token_invalid in the core) is one."""
    key = ServerKey.generate()
    h = Harness(key, Clock())
    h.outcome = lambda p: (Outcome.TOKEN_INVALID, "INVALID_ARGUMENT", 400)
    await h.run_once(trigger(key, [chunk_for(key, fcm_device())]))
    assert h.sample("pushgw_marmot_dead_tokens_total", platform="fcm") == 1


# --- Marmot's alert payload is checked by the core's own APNs check ---------------------------


def _marmot(**apns: Any) -> MarmotConfig:
    return MarmotConfig.model_validate(section(apns={"app": "ios", "mode": "alert", **apns}))


def _padded_custom(size: int) -> dict[str, str]:
    """`custom` making Marmot's alert payload exactly `size` bytes as the core encodes it."""
    base = _marmot(custom={"x": ""}).apns.payload()
    used = len(json.dumps(base, separators=(",", ":"), ensure_ascii=False).encode())
    return {"x": "é" * ((size - used) // 2) + "a" * ((size - used) % 2)}


def test_marmot_accepts_an_alert_payload_of_exactly_the_core_limit() -> None:
    custom = _padded_custom(apns_core.PAYLOAD_LIMIT)
    payload = _marmot(custom=custom).apns.payload()
    assert len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()) == (
        apns_core.PAYLOAD_LIMIT
    )
    assert apns_payload_problem(payload, "alert") is None


def test_marmot_refuses_an_alert_payload_one_byte_over_the_core_limit() -> None:
    custom = _padded_custom(apns_core.PAYLOAD_LIMIT + 1)
    with pytest.raises(ValidationError, match=f"limit {apns_core.PAYLOAD_LIMIT}"):
        _marmot(custom=custom)


@pytest.mark.parametrize(
    ("apns", "text"),
    [
        # A JSON environment override (`PUSHGW__PLUGINS__MARMOT__APNS__CUSTOM='{"x":
        # "\ud800"}'`) makes a lone surrogate, which YAML files cannot.
        ({"custom": {"x": "\ud800"}}, "\ud800"),
        # An environment variable with bytes that are not UTF-8 reaches Python as
        # surrogate escapes (`os.environ`).
        ({"alert_body": "caf\udce9"}, "caf\udce9"),
    ],
    ids=["custom", "alert_body"],
)
def test_marmot_refuses_at_load_an_alert_the_core_refuses_to_send(
    apns: dict[str, Any], text: str
) -> None:
    """Marmot sized its alert payload with its own copy of the core's encoding, but with
    `surrogatepass`: a text without a UTF-8 form passed the check at load, and the core
    then refused every alert push (`invalid_payload`), silently for the members."""
    assert apns_payload_problem({"aps": {"alert": {"body": text}}}, "alert") is not None
    with pytest.raises(ValidationError, match="not JSON-encodable"):
        _marmot(**apns)
