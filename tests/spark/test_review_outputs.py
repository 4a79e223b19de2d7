"""Review from the seat of the people who read the outputs: the on-call engineer's
`index.html` and `chart.png`, the analyst's CSV files in pandas, the data engineer's
Parquet, and the files `dead-tokens` and `volume-anomalies` hand on.

The Spark tests share one run of the three jobs over a small hostile input (markup in
app ids, plugin and reason; latencies of seconds; a group with only failures; a push
for an unknown app), written into an `--out` an earlier run over 300 apps had filled.
"""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from gateway.core.push import Outcome, ProviderKind
from spark_plugins import render, runner, synthetic
from spark_plugins.dead_tokens import JOB as DEAD_TOKENS
from spark_plugins.delivery_report import JOB as REPORT
from spark_plugins.jobs import BadLine, InputStats, JobResult
from spark_plugins.volume_anomalies import JOB as ANOMALIES
from tests.spark.conftest import START, receipt

pytestmark = pytest.mark.spark

H = 3600
HOSTILE_APP = '<script>alert("app")</script>&amp;=1+2'
HOSTILE_PLUGIN = "<i>zulip</i>"
HOSTILE_REASON = "<img src=x onerror=alert(1)>"
UNKNOWN_APP = "unknown<app>"
BAD_FILE = "bad<b>.jsonl"
TABLES = ("summary", "reasons", "hourly", "volume", "anomalies")


def _hostile_receipts() -> list[Any]:
    items = [  # 12.3456 s: a p99 of 12,346 ms
        receipt(START + i * 60, Outcome.OK, token=f"ok-{i}", app_id=HOSTILE_APP, latency=12.3456)
        for i in range(30)
    ]
    items.append(
        receipt(
            START + H,
            Outcome.TOKEN_INVALID,
            token="dead",
            app_id=HOSTILE_APP,
            reason="BadDeviceToken",
        )
    )
    items += [  # a group with failures only
        receipt(
            START + 2 * H + i,
            Outcome.TRANSIENT,
            token=f"fail-{i}",
            plugin=HOSTILE_PLUGIN,
            app_id="z",
            provider=ProviderKind.FCM,
            reason=HOSTILE_REASON,
        )
        for i in range(12)
    ]
    items.append(  # refused before sending: no latency at all
        receipt(
            START + 2 * H,
            Outcome.PERMANENT,
            token="",
            app_id=UNKNOWN_APP,
            provider=None,
            reason="unknown_app",
            attempts=0,
        )
    )
    return items


class _Tables(HTMLParser):
    """The page's tables as lists of rows of cell texts (entities decoded), and every
    tag with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _parsed(page: str) -> _Tables:
    parser = _Tables()
    parser.feed(page)
    return parser


@pytest.fixture(scope="module")
def outputs(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("review-outputs")
    out = base / "out"
    # an earlier run into the same --out, over 300 apps
    earlier = base / "earlier"
    many = [
        receipt(START + 20 * H + i, Outcome.OK, token=f"m{i}", app_id=f"app-{i:03d}")
        for i in range(300)
    ]
    synthetic.write_with_receipt_writer(many, earlier)
    jobs = [REPORT, DEAD_TOKENS, ANOMALIES]
    options = ["volume-anomalies:by=plugin,provider"]
    status, _ = runner.run_jobs(jobs, str(earlier), str(out), options, stop=False)
    assert status == 0
    earlier_page = (out / "index.html").read_text()

    receipts = base / "receipts"
    synthetic.write_with_receipt_writer(_hostile_receipts(), receipts)
    (receipts / BAD_FILE).write_text('{"v":1,"app_id":"<script>alert(2)</script>\n')
    status, results = runner.run_jobs(jobs, str(receipts), str(out), options, stop=False)
    assert status == 0
    return {"out": out, "earlier_page": earlier_page, "results": results}


def test_page_escapes_every_value_from_receipts(outputs: dict[str, Any]) -> None:
    page = (outputs["out"] / "index.html").read_text()
    for markup in ("<script", "<img src=x", "<i>", "<b>", "<app>"):
        assert markup not in page
    parsed = _parsed(page)
    assert {tag for tag, _ in parsed.tags} <= {
        *("html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "img"),
        *("table", "caption", "thead", "tbody", "tr", "th", "td"),
    }
    groups, bad = parsed.tables
    cells = {cell for row in groups for cell in row}
    assert {HOSTILE_APP, HOSTILE_PLUGIN, UNKNOWN_APP} <= cells  # shown as they are
    assert any(row[0].endswith("/" + BAD_FILE) for row in bad[1:])
    assert any("<script>alert(2)" in row[2] for row in bad[1:])


def test_page_is_self_contained(outputs: dict[str, Any]) -> None:
    page = (outputs["out"] / "index.html").read_text()
    for _, attrs in _parsed(page).tags:
        for name, value in attrs:
            if name in ("src", "href"):
                assert value is not None and value.startswith("data:"), (name, value)
    assert "url(" not in page and "@import" not in page


def test_page_numbers_agree_with_summary_csv(outputs: dict[str, Any]) -> None:
    """Latencies of seconds were shown as "1.235e+04" (4 significant digits in `%g`)."""
    import pandas as pd

    summary = pd.read_csv(outputs["out"] / "summary.csv")
    summary["provider"] = summary["provider"].fillna("-")
    per_group = summary.groupby(["plugin", "provider", "app_id"]).agg(
        total=("total", "sum"),
        ok=("ok", "sum"),
        retries=("retries", "sum"),
        p99=("latency_p99", "max"),
    )
    page = (outputs["out"] / "index.html").read_text()
    header, *rows = _parsed(page).tables[0]
    assert header == render.GROUP_HEADERS
    assert len(rows) == len(per_group) == 3
    for plugin, provider, app, pushes, rate, retries, p99 in rows:
        expected = per_group.loc[(plugin, provider, app)]
        assert int(pushes) == expected["total"] and int(retries) == expected["retries"]
        share = float(rate.removesuffix("%")) / 100  # a percentage: "98.37%"
        assert share == pytest.approx(expected["ok"] / expected["total"], abs=5e-4)
        assert "e" not in p99.lower()
        if math.isnan(expected["p99"]):
            assert p99 == ""  # sent nothing: no latency, not 0
        else:
            assert float(p99.replace(",", "")) == pytest.approx(expected["p99"], abs=0.5)
    assert per_group.loc[("matrix", "apns", HOSTILE_APP)]["p99"] > 10_000
    assert per_group.loc[(HOSTILE_PLUGIN, "fcm", "z")]["ok"] == 0  # failures only


def test_page_says_which_utc_hours_it_covers(outputs: dict[str, Any]) -> None:
    """The page named no date; the chart's axis has no year (`01-01 00`)."""
    page = (outputs["out"] / "index.html").read_text()
    text = re.sub(r"\s+", " ", page)
    assert "44 receipts in 3 hours with receipts between 2025-01-01 00:00 and" in text
    assert "2025-01-01 03:00 UTC" in text


def test_csv_files_round_trip_through_pandas(outputs: dict[str, Any]) -> None:
    import pandas as pd

    out = outputs["out"]
    summary = pd.read_csv(out / "summary.csv", parse_dates=["hour"])
    assert str(summary["hour"].dt.tz) == "UTC"
    assert list(summary["hour"].dt.hour) == [0, 1, 2, 2]
    refused = summary[summary["app_id"] == UNKNOWN_APP].iloc[0]
    assert pd.isna(refused["provider"]) and pd.isna(refused["latency_p50"])  # null, not ""
    assert summary["latency_p99"].dtype == float and summary["total"].dtype == int
    assert set(summary["app_id"]) == {HOSTILE_APP, "z", UNKNOWN_APP}  # nothing of earlier
    reasons = pd.read_csv(out / "reasons.csv", keep_default_na=False)
    assert HOSTILE_REASON in set(reasons["reason"])
    assert reasons["count"].sum() == 44
    volume = pd.read_csv(out / "volume.csv", parse_dates=["hour"])
    assert volume["complete"].dtype == bool
    assert volume["provider"].isna().any()  # the unknown app's group: null, not "None"
    assert volume["volume"].sum() == 44
    anomalies = pd.read_csv(out / "anomalies.csv")
    assert list(anomalies.columns[:3]) == ["hour", "plugin", "provider"]


def test_parquet_tables_hold_utc_instants(outputs: dict[str, Any]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in TABLES:
        directory = outputs["out"] / f"{name}.parquet"
        parts = [p.name for p in directory.iterdir() if p.name.endswith(".parquet")]
        assert len(parts) == 1, (name, parts)  # no part file of the earlier run
        table = pq.read_table(directory)
        assert table.schema.field("hour").type == pa.timestamp("us", tz="UTC"), name
    summary = pq.read_table(outputs["out"] / "summary.parquet").to_pylist()
    assert {r["app_id"] for r in summary} == {HOSTILE_APP, "z", UNKNOWN_APP}


def test_outputs_of_the_earlier_run_are_all_replaced(outputs: dict[str, Any]) -> None:
    out = outputs["out"]
    earlier = outputs["earlier_page"]
    assert "The 200 largest of 300 groups by volume" in earlier
    assert len(earlier) < 200_000  # hundreds of apps: the page stays small
    page = (out / "index.html").read_text()
    assert "app-" not in page and "largest of" not in page
    listed = {p.name for p in out.iterdir()}
    written = {Path(path).name for result in outputs["results"] for path in result.outputs.values()}
    assert listed == written  # no leftover or temporary file
    for result in outputs["results"]:
        text = (out / f"result-{result.job}.json").read_text()
        assert json.loads(text, parse_constant=pytest.fail)["input"]["records"] == 44


def test_dead_token_file_keeps_a_hostile_app_id_as_data(outputs: dict[str, Any]) -> None:
    lines = (outputs["out"] / "dead-tokens.jsonl").read_text().splitlines()
    tokens = [json.loads(line) for line in lines]
    assert [(t["app_id"], t["reason"], t["failures"]) for t in tokens] == [
        (HOSTILE_APP, "BadDeviceToken", 1)
    ]
    assert tokens[0]["last_seen"] == START + H and tokens[0]["provider"] == "apns"


# -- the page and chart alone (no Spark) ---------------------------------------------


def test_page_of_no_receipts_says_no_success_rate() -> None:
    """It read "success rate ;"."""
    result = JobResult("delivery-report", metrics={"receipts": 0, "success_rate": None})
    page = re.sub(r"\s+", " ", render.report_html([], [], result, b"").decode())
    assert "success rate -;" in page
    assert "between" not in page and "<p>none</p>" in page


def test_page_says_when_skipped_lines_are_not_all_listed() -> None:
    """With `max_bad_lines=0` the page said 'none' under "Skipped receipt lines" while
    its first paragraph counted them; a cut listing did not say it was cut."""
    stats = InputStats(files=3, bad=7, bad_files=["a", "b"], listed_all=False)
    result = JobResult("delivery-report", input=stats)
    page = render.report_html([], [], result, b"").decode()
    assert "<p>none</p>" not in page
    assert "7 skipped in 2 files in all; none listed (option max_bad_lines)" in page
    result.input.bad_lines = [BadLine("a", 1, "{"), BadLine("b", 4, "[")]
    page = render.report_html([], [], result, b"").decode()
    assert "7 skipped in 2 files in all; 2 listed (option max_bad_lines)" in page
    result.input.bad, result.input.listed_all = 2, True
    page = render.report_html([], [], result, b"").decode()
    assert "listed (option" not in page and page.count("<tr><td>") == 2


def test_numbers_on_the_page_never_take_an_exponent() -> None:
    shown = [render._fmt(v) for v in (0.8378378, 45.678, 999.4, 12345.6, 30000.0, 2.5e6)]
    assert shown == ["0.8378", "45.68", "999.4", "12,346", "30,000", "2,500,000"]
    assert render._fmt(None) == render._fmt(math.nan) == ""


def test_chart_legends_hide_no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The legends sat inside the panels' upper left corner, over the first hours'
    bars and points: with one hour of data, its p95 and p99 were hidden."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    original = Figure.savefig

    def catch(self: Figure, *args: Any, **kwargs: Any) -> Any:
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", catch)
    row = {"hour": START, "total": 50, "ok": 50, "success_rate": 1.0}
    render.chart_png([{**row, "latency_p50": 440.0, "latency_p95": 670.0, "latency_p99": 690.0}])
    (figure,) = saved
    renderer = FigureCanvasAgg(figure).get_renderer()
    legends = 0
    for ax in figure.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        legends += 1
        box, panel = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert not box.overlaps(panel), ax.get_ylabel()
        assert box.x1 <= figure.bbox.x1  # and it is not cut off either
    assert legends == 2
