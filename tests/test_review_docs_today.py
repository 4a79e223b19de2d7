"""Documentation review of today's changes: the lists a user reads (metrics, reasons,
config keys, commands, simulator options) checked against the code, so that the next
metric, reason, key or command added without its line fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.api import Outcome, Reason
from gateway.cli import _plugin_commands, build_parser
from gateway.config.sections import SHUTDOWN_DELAY_MAX, ServerConfig
from gateway.core.metrics import Metrics
from plugins.marmot.config import MarmotConfig
from plugins.marmot.keys import ServerKey
from tests.marmot.helpers import apns_device, chunk_for
from tests.marmot.test_service import Clock, Harness, trigger

ROOT = Path(__file__).resolve().parent.parent


def _text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def _folded(name: str) -> str:
    return " ".join(_text(name).split())


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    end = text.find("\n## ", start)
    return text[start : end if end != -1 else len(text)]


def _table_rows(section: str) -> list[list[str]]:
    """The cells of a Markdown table's body rows (header and rule left out)."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# --- docs/delivery.md: the metrics table is Metrics, exactly ---------------------------

_MODES = {"livesum": "sum over live workers", "max": "max", "min": "min"}


def _core_families() -> dict[str, tuple[str, tuple[str, ...], str]]:
    """Every core family as /metrics names it: (type, labels, with --workers N)."""
    metrics = Metrics(CollectorRegistry())
    families = {}
    for metric in vars(metrics).values():
        if isinstance(metric, Counter):
            families[f"{metric._name}_total"] = ("counter", metric._labelnames, "sum")
        elif isinstance(metric, Histogram):
            families[metric._name] = ("histogram", metric._labelnames, "sum")
        elif isinstance(metric, Gauge):
            # A gauge without a mode would show one series per worker pid: document it.
            mode = _MODES.get(metric._multiprocess_mode, metric._multiprocess_mode)
            families[metric._name] = ("gauge", metric._labelnames, mode)
    return families


def _documented_families() -> dict[str, tuple[str, tuple[str, ...], str]]:
    rows = _table_rows(_section(_text("docs/delivery.md"), "## Metrics"))
    documented = {}
    for name, kind, labels, workers, _meaning in rows:
        (family,) = _ticked(name)
        documented[family] = (kind, tuple(_ticked(labels)), workers)
    return documented


def test_the_metrics_table_lists_every_core_family_with_its_type_labels_and_workers() -> None:
    """docs/delivery.md had no list of the core's metrics: four families
    (`pushgw_provider_requests_total`, both latency histograms, `pushgw_receipts_written_total`)
    were named on no page, and labels and multi-process behaviour were scattered."""
    assert _documented_families() == _core_families()


def test_every_labelled_metric_the_docs_show_has_those_labels() -> None:
    families = _core_families()
    shown = re.findall(r"`(pushgw_[a-z_]+)\{([a-z_,]+)\}", _text("docs/delivery.md"))
    shown += re.findall(r"`(pushgw_[a-z_]+)\{([a-z_,]+)\}", _text("docs/configuration.md"))
    assert shown
    for name, labels in shown:
        assert set(labels.split(",")) == set(families[name][1]), name


# --- reasons ---------------------------------------------------------------------------


def _gateway_reasons() -> set[str]:
    return {v for k, v in vars(Reason).items() if k.isupper() and isinstance(v, str)}


def test_the_receipts_reason_row_lists_every_gateway_reason() -> None:
    row = next(
        line for line in _text("docs/receipts.md").splitlines() if line.startswith("| `reason`")
    )
    listed = set(_ticked(row.partition("the gateway's own (")[2].partition(";")[0]))
    assert listed == _gateway_reasons()
    assert "certificate_expired" in listed


async def test_marmot_counts_an_expired_apns_certificate_as_a_configuration_error() -> None:
    """docs/marmot.md: alert on any `pushgw_marmot_config_errors_total`. An expired APNs
    certificate ends every push `permanent`/`certificate_expired` with no HTTP status, so
    it was neither a listed reason nor a 403: the alert never fired while every Marmot
    push to iOS failed."""
    h = Harness(ServerKey.generate(), Clock())
    await h.service.start()
    try:
        h.outcome = lambda push: (Outcome.PERMANENT, Reason.CERTIFICATE_EXPIRED, None)
        await h.run(trigger(h.key, [chunk_for(h.key, apns_device())]))
        assert h.sample("pushgw_marmot_config_errors_total", reason="certificate_expired") == 1
        assert h.sample("pushgw_marmot_dead_tokens_total", platform="apns") == 0
    finally:
        await h.service.stop()
    row = next(
        line
        for line in _text("docs/marmot.md").splitlines()
        if line.startswith("| `pushgw_marmot_config_errors_total`")
    )
    assert "`certificate_expired`" in row


# --- configuration keys ----------------------------------------------------------------


def _marmot_documented_keys() -> set[str]:
    rows = _table_rows(
        _section(_text("docs/marmot.md"), "## 2. Configuration reference (`plugins.marmot`)")
    )
    keys = set()
    for row in rows:
        for key in _ticked(row[0]):
            keys.add(key.split(" /")[0].split(".")[0])
    return keys


def test_every_marmot_key_is_in_its_configuration_table() -> None:
    fields = {field.alias or name for name, field in MarmotConfig.model_fields.items()}
    assert fields <= _marmot_documented_keys()
    assert "ca_file" in fields


def test_server_shutdown_delay_is_documented_with_its_default_and_bound() -> None:
    field = ServerConfig.model_fields["shutdown_delay"]
    assert field.default == 0.0 and SHUTDOWN_DELAY_MAX == 3600
    assert "`server.shutdown_delay` (0 s, at most 3600)" in _folded("docs/configuration.md")
    assert "shutdown_delay: 0.0 " in _text("config/production.example.yaml")
    assert "server.shutdown_delay" in _text("docs/kubernetes.md")


# --- commands --------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_cli_md_names_every_plugin_command() -> None:
    """docs/cli.md, the page on the `pushgw` command, named none of the plugins'
    commands: `pushgw zulip forget`, today's erasure command, was not there."""
    core = {"serve", "check-config", "plugins", "db", "tokens", "receipts", "simulate"}
    groups = {
        name: parser
        for name, parser in _subcommands(build_parser(_plugin_commands)).items()
        if name not in core
    }
    assert {"zulip", "marmot", "spark"} <= set(groups)
    section = _section(_text("docs/cli.md"), "## Plugin commands")
    for group, parser in groups.items():
        rows = [row for row in section.splitlines() if f"`pushgw {group} " in row]
        words = {word for row in rows for cell in _ticked(row) for word in cell.split()}
        for command, sub in _subcommands(parser).items():
            assert command in words, f"pushgw {group} {command}"
            for nested in _subcommands(sub):
                assert nested in words, f"pushgw {group} {command} {nested}"
    forget = next(row for row in section.splitlines() if "`pushgw zulip forget`" in row)
    for status in ("0 ", "1 ", "2 "):
        assert status in forget


def test_zulip_forget_help_names_every_option_the_docs_show() -> None:
    forget = _subcommands(_subcommands(build_parser(_plugin_commands))["zulip"])["forget"]
    options = {o for action in forget._actions for o in action.option_strings} - {"-h", "--help"}
    zulip = _folded("docs/zulip.md")
    for option in options:
        assert option in zulip, option


# --- docs/plugins.md: the simulator options today's changelog names ---------------------


def test_plugins_md_names_every_simulator_api_the_unreleased_changelog_adds() -> None:
    unreleased = _text("CHANGELOG.md").split("## [Unreleased]")[1].split("\n## [")[0]
    named = set(
        re.findall(
            r"`(?:ApnsSimulator|FcmSimulator|FcmResponse|ApnsResponse|SimulatorCA)"
            r"[.(]([a-z_]+)",
            unreleased,
        )
    )
    assert {"revoke_jwt_key", "add_device", "quota_exceeded", "token_update_interval"} <= named
    plugins = _text("docs/plugins.md")
    for name in named:
        assert re.search(rf"\b{name}\b", plugins), name
    for keyword in ("scope=", "retry_delay="):
        assert keyword in plugins


# --- new pages and files are where a user looks ----------------------------------------


def test_the_new_pages_and_files_are_linked() -> None:
    readme = _text("README.md")
    for target in ("docs/kubernetes.md", "config/alerts.yml", "config/grafana-dashboard.json"):
        assert f"]({target})" in readme, target
    for page in ("configuration.md", "cli.md", "delivery.md"):
        assert "](kubernetes.md" in _text(f"docs/{page}"), page
    delivery = _text("docs/delivery.md")
    assert "](../config/alerts.yml)" in delivery or "config/alerts.yml" in delivery
    assert "](../config/grafana-dashboard.json)" in delivery
