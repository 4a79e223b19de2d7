"""Review from an operator's seat: messy receipt directories, reused output directories,
the outputs a data person opens, and the dead-token file fed back to the gateway.

Each test failed against the code before its fix (docs/spark.md describes the behaviour).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gateway.core.push import Outcome, ProviderKind, Receipt
from gateway.dead_tokens import read_dead_tokens
from spark_plugins import render, runner, synthetic
from spark_plugins.dead_tokens import JOB as DEAD_TOKENS
from spark_plugins.delivery_report import JOB as REPORT
from spark_plugins.reader import TS_MAX
from spark_plugins.volume_anomalies import JOB as ANOMALIES
from tests.spark.conftest import START, receipt

pytestmark = pytest.mark.spark

H = 3600


def _hourly(hour: float, ok: int = 9) -> dict[str, Any]:
    """An hourly row as delivery-report collects it (epoch seconds)."""
    return {
        "hour": int(hour),
        "total": 10,
        "ok": ok,
        "success_rate": ok / 10,
        "latency_p50": 40.0,
        "latency_p95": 80.0,
        "latency_p99": 120.0,
    }


def _drawn_figure(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]]) -> Any:
    """The matplotlib figure `render.chart_png` draws for `rows` (caught as it is saved)."""
    from matplotlib.figure import Figure

    saved: list[Any] = []
    original = Figure.savefig

    def catch(self: Figure, *args: Any, **kwargs: Any) -> Any:
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", catch)
    render.chart_png(rows)
    assert len(saved) == 1
    return saved[0]


def test_chart_lines_break_at_hours_without_receipts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A day without traffic (a quiet weekend, an outage) has no hourly rows. The success
    rate and latency lines were drawn straight across it, as if the hours in between had
    had those values; the bars were centred on the hour's start, half an hour early."""
    from matplotlib.dates import date2num

    hours = [START + i * H for i in range(6)] + [START + (30 + i) * H for i in range(6)]
    figure = _drawn_figure(monkeypatch, [_hourly(h) for h in hours])
    volume, rate, latency = figure.axes
    lines = rate.get_lines() + latency.get_lines()
    assert len(lines) == 4
    one_hour = 1 / 24  # matplotlib dates are in days
    for line in lines:
        xs = [float(x) for x in date2num(line.get_xdata())]
        ys = [float(y) for y in line.get_ydata()]
        drawn = [
            (xs[i], xs[i + 1])
            for i in range(len(xs) - 1)
            if math.isfinite(ys[i]) and math.isfinite(ys[i + 1])
        ]
        assert drawn, line.get_label()
        # a segment joins two consecutive hours, never two hours a gap apart
        assert all(b - a <= one_hour + 1e-9 for a, b in drawn), line.get_label()
        finite = sorted(x for x, y in zip(xs, ys, strict=True) if math.isfinite(y))
        assert len(finite) == len(hours)  # every hour with receipts is still a point
    from datetime import UTC, datetime

    starts = sorted({round(bar.get_x(), 9) for bar in volume.patches})
    expected = [round(float(date2num(datetime.fromtimestamp(h, tz=UTC))), 9) for h in hours]
    assert starts == expected  # each bar covers its hour, [hour, hour + 1h)


@pytest.mark.parametrize(
    ("job", "value"),
    [(ANOMALIES, "1e30"), (ANOMALIES, "1e400"), (DEAD_TOKENS, "1e400"), (ANOMALIES, "5e9")],
)
def test_now_beyond_2099_is_a_usage_error_before_spark(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    job: Any,
    value: str,
) -> None:
    """`--option now=1e30` for volume-anomalies was accepted, then the job failed once
    Spark was up with a Java NumberFormatException (`1e400`: "cannot convert float NaN to
    integer"); dead-tokens took infinity and silently retired nothing."""

    def no_session(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Spark must not start on a usage error")

    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", no_session)
    (tmp_path / "receipts").mkdir()
    status, _ = runner.run_jobs(
        [job], str(tmp_path / "receipts"), str(tmp_path / "out"), [f"now={value}"]
    )
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"pushgw spark: job {job.name}: option now: must be <= ")
    assert not (tmp_path / "out").exists()
    # the last second receipts may have is accepted
    assert job.resolve_options([f"now={TS_MAX}"])["now"] == TS_MAX


def test_dead_token_file_is_one_tokens_retire_accepts(spark: Any, tmp_path: Path) -> None:
    """Receipts are semi-trusted input. One with a reason holding a newline or a tab, or
    with a token hash that is not 64 lowercase hex characters, made the job write a line
    `pushgw tokens retire` refuses, and a file with one bad line retires nothing at all."""

    def forged(token_hash: str, *, plugin: str = "matrix") -> Receipt:
        return Receipt(
            push_id="p-" + token_hash,
            plugin=plugin,
            app_id="im.vector.app.ios",
            provider=ProviderKind.APNS,
            outcome=Outcome.TOKEN_INVALID,
            status=410,
            reason="BadDeviceToken",
            attempts=1,
            latency=0.05,
            finished_at=START + H,
            token_hash=token_hash,
        )

    items = [
        receipt(START, Outcome.TOKEN_INVALID, token="plain", reason="Unregistered"),
        receipt(START, Outcome.TOKEN_INVALID, token="odd", reason="Bad\nDevice\tToken\x7f"),
        forged("NOT-A-HASH"),
        forged("AB" * 32),  # upper case: not the receipts' hex
        forged(synthetic.token_hash("ctl"), plugin="mat\trix"),
        forged(synthetic.token_hash("empty"), plugin=""),
    ]
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts)
    out = tmp_path / "out"
    result = DEAD_TOKENS.run(spark, str(receipts), str(out), DEAD_TOKENS.resolve_options({}))
    tokens, duplicates = read_dead_tokens(out / "dead-tokens.jsonl")  # raised before the fix
    assert duplicates == 0
    by_hash = {t.token_hash: t for t in tokens}
    assert set(by_hash) == {synthetic.token_hash("plain"), synthetic.token_hash("odd")}
    assert by_hash[synthetic.token_hash("plain")].reason == "Unregistered"
    assert by_hash[synthetic.token_hash("odd")].reason == "Bad Device Token "
    # what could not be written is counted, not silently lost
    assert result.metrics["tokens_retired"] == 2
    assert result.metrics["tokens_not_retirable"] == 4
    saved = json.loads((out / "result-dead-tokens.json").read_text())
    assert saved["metrics"]["tokens_not_retirable"] == 4


def test_chart_off_leaves_no_stale_chart_or_page(spark: Any, tmp_path: Path) -> None:
    """`--out` reused from an earlier run: with `chart=false` the earlier run's chart.png
    and index.html stayed beside the new tables, a page of other data that a person
    opens as this run's report."""
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(
        [receipt(START + i, Outcome.OK, token=f"t{i}") for i in range(5)], receipts
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "chart.png").write_bytes(b"an earlier run's chart")
    (out / "index.html").write_text("<p>an earlier run's report</p>")
    options = REPORT.resolve_options({"chart": False})
    result = REPORT.run(spark, str(receipts), str(out), options)
    assert not (out / "chart.png").exists()
    assert not (out / "index.html").exists()
    assert "index.html" not in result.outputs
    assert (out / "summary.csv").read_text().count("\n") == 2  # header + one group-hour


def _no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_session(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Spark must not start on a usage error")

    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", no_session)


@pytest.mark.parametrize("layout", ["loop", "loop to a parent", "two routes", "file link"])
def test_a_directory_reached_twice_through_a_symlink_is_a_usage_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    layout: str,
) -> None:
    """Spark follows symbolic links while it lists the receipts recursively. A link back
    up the tree (`current -> .`) had it read every file once per level until the path
    grew too long (41 times over here: every count of every report 41x, silently); a
    second route to a node's directory counted its receipts twice."""
    _no_spark(monkeypatch)
    receipts = tmp_path / "receipts"
    node = receipts / "node-a"
    node.mkdir(parents=True)
    (node / "receipts-1.jsonl").write_text("")
    if layout == "loop":
        (node / "current").symlink_to(".")
    elif layout == "loop to a parent":
        (node / "up").symlink_to("..")
    elif layout == "two routes":
        (receipts / "all").mkdir()
        (receipts / "all" / "node-a").symlink_to(node)
    else:
        (receipts / "latest.jsonl").symlink_to(node / "receipts-1.jsonl")
    status, _ = runner.run_jobs([DEAD_TOKENS], str(receipts), str(tmp_path / "out"))
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"pushgw spark: receipts directory {receipts}: ")
    assert "would be read twice" in err[0]
    assert not (tmp_path / "out").exists()


def test_symlinks_to_directories_read_once_are_fine(tmp_path: Path) -> None:
    """A link to a directory outside (another disk), links Spark never follows (hidden
    or `_`-prefixed names) and a link to a file read only through it are no problem."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    receipts = tmp_path / "receipts"
    receipts.mkdir()
    (receipts / "node-b").symlink_to(elsewhere)
    (receipts / ".snapshot").symlink_to(".")
    (receipts / "_old").symlink_to(".")
    (elsewhere / "file.jsonl").write_text("")
    (tmp_path / "single.jsonl").write_text("")
    (receipts / "single.jsonl").symlink_to(tmp_path / "single.jsonl")
    (receipts / "_same.jsonl").symlink_to(elsewhere / "file.jsonl")
    assert runner.path_problem(str(receipts), str(tmp_path / "out")) is None
