"""Documentation drift review: what docs/ and README.md say about the day's changes,
checked against the code (names, defaults, reason lists, log-volume rules)."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import gateway.api
import gateway.hookspecs
from gateway.core import classify, fcm, store, tokens
from gateway.core.dispatcher import Dispatcher
from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken, Outcome, Receipt
from gateway.core.receipts import receipt_record
from gateway.logs import RepeatedLines

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _text(name: str) -> str:
    """A document with its line breaks and indentation folded into single spaces."""
    return " ".join((ROOT / name).read_text(encoding="utf-8").split())


def _between(text: str, start: str, end: str) -> str:
    head = text.index(start) + len(start)
    return text[head : text.index(end, head)]


def _without_parentheses(text: str) -> str:
    """`text` without any (possibly nested) parenthesised part."""
    out, depth = [], 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(char)
    return "".join(out)


def _ticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


# --- the plugin API ----------------------------------------------------------------------


def test_the_plugin_api_list_is_gateway_api_all() -> None:
    section = _between(_text("docs/plugins.md"), "That module exports:", "## The context")
    listed = _ticked(_without_parentheses(section))
    assert listed == set(gateway.api.__all__)


def test_the_token_invalid_hook_lists_every_invalid_token_field() -> None:
    section = _between(_text("docs/plugins.md"), "### `pushgw_token_invalid`", "###")
    listed = {name.split()[0] for name in _ticked(_between(section, "an `InvalidToken` (", ")."))}
    fields = {f.name for f in dataclasses.fields(InvalidToken)} - {"plugin"}  # the hook's owner
    assert listed == fields
    assert "observed_at" in section


def test_the_token_invalid_hookspec_tells_of_observed_at_and_the_second_report() -> None:
    doc = " ".join((gateway.hookspecs.pushgw_token_invalid.__doc__ or "").split())
    assert "observed_at" in doc
    assert "and again for an answer to a push sent after that call" in doc


# --- delivery.md: the outage log, APNs reasons, FCM timings -----------------------------


def test_the_documented_configuration_reasons_are_the_dispatchers() -> None:
    section = _between(
        _text("docs/delivery.md"),
        "refusing an app's pushes for a configuration reason (",
        ": pushes",
    )
    assert _ticked(section) == set(classify.CONFIG_REASONS)


def test_the_documented_reconnect_and_key_scoping_reasons_are_the_classifiers() -> None:
    text = _text("docs/delivery.md")
    reconnect = _between(text, "After an answer that asks for a new connection (", ")")
    assert _ticked(reconnect) == set(classify.APNS_RECONNECT)
    assert "UnrelatedKeyIdInToken" in classify.APNS_AUTH
    for spelling in ("BadEnvironmentKeyIdInToken", "BadEnvironmentKeyInToken"):
        assert f"`{spelling}`" in text
        assert spelling in classify.APNS_PERMANENT
        assert spelling not in classify.APNS_TOKEN_INVALID


def test_the_documented_timings_are_the_codes() -> None:
    delivery = _text("docs/delivery.md")
    assert fcm.FETCH_RETRY == 2.0
    assert "a failed fetch is not tried again for 2 s" in delivery
    assert fcm.REFUSED_REFETCH == 60.0
    assert "the next token request waits 60 s" in delivery
    assert Dispatcher.config_quiet == 60.0
    assert "accepted again after 60 s without such a failure" in delivery
    assert tokens._RECENT_SECONDS == 60.0
    assert "concurrent answers for one token within 60 s are one report" in delivery
    assert store.PING_TIMEOUT == 5.0
    assert "`SELECT 1` within 5 s" in delivery
    assert "`SELECT 1` within 5 s" in _text("docs/configuration.md")


def test_the_core_metrics_the_docs_name_exist() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    # A labelled family has no sample before its first child: its name, and a counter's
    # `_total`, are what /metrics shows once one exists.
    samples = {family.name for family in registry.collect()} | {
        f"{family.name}_total" for family in registry.collect() if family.type == "counter"
    }
    hooks = {name for name in dir(gateway.hookspecs) if name.startswith("pushgw_")}
    named = set()
    for page in ("docs/delivery.md", "docs/receipts.md", "docs/configuration.md"):
        named |= set(re.findall(r"`(pushgw_[a-z0-9_]+)", _text(page)))
    named -= hooks
    assert named, "the pages name metrics"
    assert named - {"pushgw_invalid_tokens"} <= samples


# --- RepeatedLines, as docs/plugins.md describes it --------------------------------------


def test_repeated_lines_admit_once_a_minute_and_count_the_repeats() -> None:
    now = [1000.0]
    lines = RepeatedLines(clock=lambda: now[0])
    assert lines.interval == 60.0
    assert lines.admit(("app", "transient")) == (0, 0)
    assert lines.admit(("app", "transient"), 3) is None  # a repeat: for DEBUG
    assert lines.admit(("app", "auth")) == (0, 0)  # another kind of line is its own
    now[0] += 59.9
    assert lines.admit(("app", "transient")) is None
    now[0] += 0.2
    assert lines.admit(("app", "transient")) == (2, 4)  # two repeats, counts 3 + 1
    assert lines.admit(("app", "transient")) is None


# --- receipts.md -------------------------------------------------------------------------


def test_a_lone_surrogate_in_a_reason_is_written_as_documented() -> None:
    receipt = Receipt(
        push_id="x",
        plugin="p",
        app_id="a",
        provider=None,
        outcome=Outcome.PERMANENT,
        status=400,
        reason="bad \ud800 reason",
        attempts=1,
        latency=0.1,
        finished_at=1_700_000_000.0,
    )
    assert receipt_record(receipt)["reason"] == "bad \ufffd reason"
    row = next(
        line
        for line in (DOCS / "receipts.md").read_text().splitlines()
        if line.startswith("| `reason`")
    )
    assert "U+FFFD" in row


def test_the_readme_says_readyz_reports_the_receipts() -> None:
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if "/readyz" in line)
    assert "receipts" in line
    assert '"receipts": false' in _text("docs/receipts.md")


# --- plugin pages: defaults quoted as numbers --------------------------------------------


def test_matrix_latest_answer_is_the_documented_sum() -> None:
    from plugins.matrix.config import HOMESERVER_TIMEOUT, MatrixAppConfig, MatrixConfig

    deadline = MatrixConfig.model_fields["notify_deadline"].default
    request_timeout = MatrixAppConfig.model_fields["request_timeout"].default
    text = _text("docs/matrix.md")
    assert "(25 s by default)" in text and deadline + request_timeout == 25
    assert f"(within its app's `request_timeout`, default {request_timeout:g} s)" in text
    assert HOMESERVER_TIMEOUT == 60 and "Synapse's 60 s request timeout" in text
    assert "requests dropped at `inflight_request_limit`" in text


def test_zulip_defaults_are_the_documented_ones() -> None:
    from plugins.zulip.config import ZulipConfig

    fields = ZulipConfig.model_fields
    text = _text("docs/zulip.md")
    assert fields["server_in_flight"].default == 200
    assert "`server_in_flight` (200)" in text
    assert fields["notify_deadline"].default == 10
    assert "within `notify_deadline` (10 s, Zulip waits 15 s)" in text
    assert fields["push_deadline"].default == 30
    assert "within `push_deadline` (30 s)" in text


def test_the_pool_sizing_numbers_are_sqlalchemys() -> None:
    engine = store.create_engine("postgresql+asyncpg://nobody@127.0.0.1:9/none")
    pool = engine.sync_engine.pool
    assert pool.size() == 10
    assert pool._max_overflow == 10  # type: ignore[attr-defined]
    assert "`store.pool_size` (10) connections kept open, plus up to 10 more" in _text(
        "docs/configuration.md"
    )


def test_spark_md_names_every_sql_setting_the_jobs_set() -> None:
    from spark_plugins.session import SQL_CONF

    text = _text("docs/spark.md")
    words = {3: "three", 4: "four", 5: "five", 6: "six"}
    assert f"the jobs only set {words[len(SQL_CONF)]} SQL settings" in text
    for key, value in SQL_CONF.items():
        assert f"`{key}={value}`" in text


@pytest.mark.parametrize("failures", range(1, 10))
def test_marmot_backoff_is_drawn_where_marmot_md_says(
    failures: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plugins.marmot.keys import ServerKey
    from plugins.marmot.relay import RelayClient, RelaySettings

    settings = RelaySettings(backoff_min=1.0, backoff_max=60.0)
    client = RelayClient("ws://r", ServerKey.generate(), None, settings)  # type: ignore[arg-type]
    client.failures = failures
    # The doc: the n-th delay between min x 2^(n-1) and twice that; from backoff_max on,
    # between half of it and it; never below backoff_min.
    step = settings.backoff_min * 2 ** (failures - 1)
    low, high = (step, 2 * step) if 2 * step <= settings.backoff_max else (30.0, 60.0)
    low = max(low, settings.backoff_min)
    monkeypatch.setattr(random, "uniform", lambda a, b: a)
    assert client._backoff() == low
    monkeypatch.setattr(random, "uniform", lambda a, b: b)
    assert client._backoff() == high
    text = _text("docs/marmot.md")
    assert (
        "the n-th delay in a row is drawn between `backoff_min` \u00d7 2^(n\u22121) and twice that"
        in text
    )
