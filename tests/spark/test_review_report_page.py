"""Review from the seat of the people who open the delivery report page: with a screen
reader, on a phone, in dark mode, on paper (WCAG 2.2 AA where it applies).

The page and chart are built from plain rows (`render.report_html`, `render.chart_png`):
no Spark. The page is read with `html.parser`, the chart as the matplotlib figure it
saves.
"""

from __future__ import annotations

import itertools
import re
from html.parser import HTMLParser
from typing import Any

import pytest

from spark_plugins import render
from spark_plugins.jobs import BadLine, InputStats, JobResult
from tests.spark.conftest import START
from tests.spark.test_review_operator import _drawn_figure

H = 3600
HOSTILE = '<script>alert("x")</script>&amp;"\'=1'


class _Page(HTMLParser):
    """Every element in order with its attributes, the text of each element, the
    style sheet, and the tables (caption, header cells, rows of cell texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.texts: dict[str, list[str]] = {}
        self.tables: list[dict[str, Any]] = []
        self._open: list[str] = []
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag == "table":
            self.tables.append({"caption": None, "first": None, "th": [], "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        if tag not in ("meta", "img"):  # void elements: no end tag
            self._open.append(tag)
            self._text = []
            if self.tables and self.tables[-1]["first"] is None and tag != "table":
                self.tables[-1]["first"] = tag  # the table's first child

    def handle_endtag(self, tag: str) -> None:
        text = "".join(self._text)
        self.texts.setdefault(tag, []).append(text)
        if tag == "caption":
            self.tables[-1]["caption"] = text
        elif tag == "th":
            self.tables[-1]["th"].append(dict(self.tags[-1][1]) | {"text": text})
        elif tag == "td":
            self.tables[-1]["rows"][-1].append(text)
        if self._open and self._open[-1] == tag:
            self._open.pop()
        self._text = []

    def handle_data(self, data: str) -> None:
        self._text.append(data)

    def attr(self, tag: str, name: str) -> str | None:
        return next(attrs.get(name) for t, attrs in self.tags if t == tag)


def _parsed(page: bytes) -> _Page:
    parser = _Page()
    parser.feed(page.decode())
    parser.close()
    return parser


def _hourly(hour: float, total: int = 100, ok: int = 95, p99: float = 120.0) -> dict[str, Any]:
    """An hourly row as delivery-report collects it (epoch seconds)."""
    return {
        "hour": int(hour),
        "total": total,
        "ok": ok,
        "success_rate": ok / total,
        "latency_p50": 40.0,
        "latency_p95": 80.0,
        "latency_p99": p99,
    }


def _group(app_id: str, total: int, ok: int, **changes: Any) -> dict[str, Any]:
    """A summary row (one hour of one group)."""
    row = {
        "plugin": "zulip",
        "provider": "apns",
        "app_id": app_id,
        "total": total,
        "ok": ok,
        "retries": 0,
        "latency_p99": 50.0,
    }
    return {**row, **changes}


def _page(
    hourly: list[dict[str, Any]] | None = None,
    summary: list[dict[str, Any]] | None = None,
    bad_lines: list[BadLine] | None = None,
) -> bytes:
    hourly = hourly or []
    summary = summary or []
    receipts = sum(r["total"] for r in hourly)
    ok = sum(r["ok"] for r in hourly)
    result = JobResult(
        "delivery-report",
        metrics={
            "receipts": receipts,
            "ok": ok,
            "success_rate": ok / receipts if receipts else None,
            "hours": len(hourly),
        },
        input=InputStats(files=1, bad=len(bad_lines or []), bad_lines=bad_lines or []),
    )
    return render.report_html(hourly, summary, result, render.chart_png(hourly))


def _words(page: bytes) -> str:
    return re.sub(r"\s+", " ", page.decode())


def _luminance(rgb: tuple[float, ...]) -> float:
    """WCAG relative luminance of an sRGB colour (channels 0 to 1)."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def _contrast(a: Any, b: Any) -> float:
    from matplotlib.colors import to_rgb

    la, lb = sorted((_luminance(to_rgb(a)), _luminance(to_rgb(b))), reverse=True)
    return (la + 0.05) / (lb + 0.05)


# -- numbers as a person reads them ---------------------------------------------------


def test_success_rate_below_100_percent_never_reads_as_100() -> None:
    """40 failures in 1M pushes showed "success rate 1" (4 significant digits of
    0.99996) in the headline and the group's row, as if none had failed. The
    chart's axis says "success rate (%)", the page gave fractions."""
    hourly = [_hourly(START, total=1_000_000, ok=999_960)]
    summary = [_group("busy", 1_000_000, 999_960), _group("dead", 30_000, 1)]
    page = _page(hourly, summary)
    assert "success rate 99.996%;" in _words(page)
    rows = {row[2]: row for row in _parsed(page).tables[0]["rows"] if row}
    assert rows["busy"][4] == "99.996%"
    assert rows["dead"][4] == "0.003%"  # 1 in 30,000 was "3.333e-05"


@pytest.mark.parametrize(
    ("rate", "shown"),
    [
        (1.0, "100%"),
        (0.0, "0%"),
        (0.98372, "98.37%"),
        (0.5, "50.00%"),
        (0.999999, "99.9999%"),
        (1 / 3_000_000, "0.00003%"),
        (None, ""),
        (float("nan"), ""),
    ],
)
def test_rates_are_percentages_that_keep_their_failures(rate: Any, shown: str) -> None:
    assert render._percent(rate) == shown


def test_counts_have_thousands_separators() -> None:
    """Pushes and receipts read "1234567" beside latencies of "12,346" ms."""
    hourly = [_hourly(START, total=1_234_567, ok=1_234_567)]
    bad = [BadLine("receipts/a.jsonl", 12345, "{")]
    page = _page(hourly, [_group("a", 1_234_567, 1_234_567, retries=20_000)], bad)
    assert "1,234,567 receipts in 1 hour with receipts" in _words(page)
    groups, skipped = _parsed(page).tables
    assert groups["rows"][1][3] == "1,234,567" and groups["rows"][1][5] == "20,000"
    assert skipped["rows"][1][1] == "12345"  # a line number as an editor shows it


# -- the chart for someone who cannot see it -------------------------------------------


def test_chart_alt_text_says_what_the_chart_shows_with_its_key_numbers() -> None:
    """The alt text was "volume, success rate and latency per hour" whatever the chart
    showed: a screen reader user learnt nothing of the busiest hour, the worst success
    rate or the slowest p99."""
    hourly = [
        _hourly(START, total=100, ok=99),
        _hourly(START + H, total=2_500, ok=2_000, p99=15_000.0),
        _hourly(START + 2 * H, total=300, ok=300),
    ]
    alt = _parsed(_page(hourly)).attr("img", "alt") or ""
    assert "3 UTC hours" in alt
    assert "between 2025-01-01 00:00 and 2025-01-01 03:00 UTC" in alt
    assert "most pushes in an hour 2,500 at 2025-01-01 01:00" in alt
    assert "lowest success rate 80.00% at 2025-01-01 01:00" in alt
    assert "highest p99 latency 15,000 ms at 2025-01-01 01:00" in alt


def test_alt_text_of_an_empty_report_says_there_is_nothing() -> None:
    """It described volume, success rate and latency over a chart reading "no receipts"."""
    assert _parsed(_page()).attr("img", "alt") == "Chart: no receipts."
    assert render.chart_alt([{"hour": None, "total": 1}]) == "Chart: no hours to plot."


def test_alt_text_stays_short_for_thousands_of_hours_and_garbage() -> None:
    hourly = [_hourly(START + i * H, total=100 + i % 70, ok=90) for i in range(5000)]
    alt = render.chart_alt(hourly)
    assert "5,000 UTC hours" in alt and "most pushes in an hour 169" in alt
    assert len(alt) < 400
    garbage = [
        {"hour": START, "total": None, "ok": None, "success_rate": float("nan")},
        {"hour": START + H, "total": 5, "success_rate": float("-inf"), "latency_p99": 2**1100},
    ]
    alt = render.chart_alt(garbage)  # never raises
    assert "most pushes in an hour 5 at 2025-01-01 01:00" in alt
    assert "success rate" not in alt


def test_chart_series_are_told_apart_by_more_than_colour(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """p50, p95 and p99 were the same small dots in three colours, "ok" and "not ok"
    bars green and red (WCAG 1.4.1): with one hour, a red-green colour-blind reader or a
    greyscale print could not tell p50 from p99."""
    figure = _drawn_figure(monkeypatch, [_hourly(START)])
    volume, _, latency = figure.axes
    styles = {(line.get_marker(), line.get_linestyle()) for line in latency.get_lines()}
    assert len(styles) == 3
    assert all(marker not in (".", ",", "None", "") for marker, _ in styles)
    handles = volume.get_legend().legend_handles
    assert len({bool(handle.get_hatch()) for handle in handles}) == 2  # one hatched
    hatched = [bar for bar in volume.patches if bar.get_hatch()]
    assert len(hatched) == len(volume.patches) // 2  # every "not ok" bar


def test_chart_colours_have_3_to_1_contrast_against_their_panel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WCAG 1.4.11: the p95 line was matplotlib's orange, 2.5:1 on white."""
    figure = _drawn_figure(monkeypatch, [_hourly(START), _hourly(START + H)])
    for ax in figure.axes:
        panel = ax.get_facecolor()
        for line in ax.get_lines():
            assert _contrast(line.get_color(), panel) >= 3, (ax.get_ylabel(), line.get_label())
        for bar in ax.patches:
            assert _contrast(bar.get_facecolor(), panel) >= 3, ax.get_ylabel()
        for text in [ax.title, ax.xaxis.label, ax.yaxis.label]:
            assert _contrast(text.get_color(), panel) >= 4.5


# -- the page's structure, for a screen reader, a phone, dark mode and paper -----------


def test_page_has_language_title_viewport_and_headings_in_order() -> None:
    """Without a viewport meta a phone lays the page out 980 px wide and shrinks it."""
    parsed = _parsed(_page([_hourly(START)], [_group("a", 100, 95)]))
    assert parsed.attr("html", "lang") == "en"
    assert parsed.texts["title"] == ["pushgw delivery report"]
    viewport = [a.get("content") for t, a in parsed.tags if a.get("name") == "viewport"]
    assert viewport == ["width=device-width, initial-scale=1"]
    headings = [int(tag[1]) for tag, _ in parsed.tags if re.fullmatch(r"h[1-6]", tag)]
    assert headings[0] == 1 and headings.count(1) == 1
    assert all(b - a <= 1 for a, b in itertools.pairwise(headings))


def test_tables_have_captions_and_column_headers() -> None:
    page = _page([_hourly(START)], [_group("a", 100, 95)], [BadLine("receipts/b.jsonl", 3, "{")])
    tables = _parsed(page).tables
    assert len(tables) == 2
    for table in tables:
        assert table["first"] == "caption" and table["caption"]
        assert table["th"] and all(th.get("scope") == "col" for th in table["th"])
    assert "largest first" in tables[0]["caption"]  # the order of its rows


def _rules(page: bytes) -> list[tuple[str, str, dict[str, str]]]:
    """The style sheet's rules as (media query or "", selector, declarations)."""
    css = _parsed(page).texts["style"][0]
    rules = []
    media = ""
    for block in re.finditer(r"\s*(?:(@media[^{]*)\{|([^{}]+)\{([^}]*)\}|\})", css):
        if block.group(1):
            media = block.group(1).strip()
        elif block.group(2):
            declarations = dict(
                (name.strip(), value.strip())
                for name, _, value in (d.partition(":") for d in block.group(3).split(";"))
                if value.strip()
            )
            rules.append((media, block.group(2).strip(), declarations))
        else:
            media = ""
    return rules


def test_text_colour_always_comes_with_its_background() -> None:
    """The page set its text colour (#222) and left the background to the browser: with
    a dark default background (a reader's own colours, WCAG failure F24) the text was
    dark on dark. In dark mode the page now follows the reader's scheme."""
    page = _page([_hourly(START)], [_group("a", 100, 95)])
    parsed = _parsed(page)
    schemes = [a.get("content") for t, a in parsed.tags if a.get("name") == "color-scheme"]
    assert schemes == ["light dark"]
    rules = _rules(page)
    body = {media: decl for media, selector, decl in rules if selector == "body"}
    assert set(body) >= {"", "@media (prefers-color-scheme: dark)", "@media print"}
    for media, decl in body.items():
        if "color" in decl:
            assert "background" in decl, media
            assert _contrast(decl["color"], decl["background"]) >= 4.5, media
    headers = {media: decl for media, selector, decl in rules if selector == "th"}
    for media in ("", "@media (prefers-color-scheme: dark)"):
        text = body[media]["color"]
        assert _contrast(text, headers[media]["background"]) >= 4.5, media


def test_long_values_wrap_instead_of_widening_the_page() -> None:
    """A 120-character bad line (JSON has no spaces) or a long app id made the table as
    wide as the unbroken text: on a phone the page scrolled sideways."""
    long_id = "com." + "x" * 200
    page = _page(
        [_hourly(START)],
        [_group(long_id, 100, 95)],
        [BadLine("receipts/a.jsonl", 1, '{"v":1,"app_id":"' + "y" * 200)],
    )
    wrapping = [
        selector
        for media, selector, decl in _rules(page)
        if media == "" and decl.get("overflow-wrap") == "anywhere"
    ]
    assert wrapping == ["td:nth-child(-n+3)"]  # plugin, provider, app; file, line, text
    images = [decl for media, selector, decl in _rules(page) if selector == "img" and not media]
    assert images and images[0]["max-width"] == "100%"


# -- sizes and contents ----------------------------------------------------------------


def test_empty_report_says_so_in_words() -> None:
    """No receipts: the group table was a header row over nothing."""
    page = _page()
    parsed = _parsed(page)
    assert parsed.tables == []
    text = _words(page)
    assert "0 receipts in 0 hours with receipts, from 1 file; success rate -;" in text
    assert "<h2>Per plugin, provider and app</h2> <p>no receipts</p>" in text


def test_page_stays_bounded_for_thousands_of_hours_and_groups() -> None:
    hourly = [_hourly(START + i * H) for i in range(3000)]
    summary = [_group(f"app-{i:04d}", 10 + i, 9) for i in range(1000)]
    page = _page(hourly, summary)
    html_only = re.sub(rb"data:image/png;base64,[A-Za-z0-9+/=]+", b"", page)
    assert len(html_only) < 100_000
    assert len(page) - len(html_only) < 500_000  # the chart's size does not grow with hours
    groups = _parsed(page).tables[0]["rows"]
    assert len(groups) - 1 == render.MAX_PAGE_GROUPS
    assert "The 200 largest of 1,000 groups by volume" in _words(page)


def test_every_value_from_receipts_is_escaped() -> None:
    page = _page(
        [_hourly(START)],
        [_group(HOSTILE, 10, 5, plugin=HOSTILE, provider=HOSTILE)],
        [BadLine(HOSTILE, 7, HOSTILE)],
    )
    parsed = _parsed(page)
    assert {tag for tag, _ in parsed.tags} <= {
        *("html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "img"),
        *("table", "caption", "thead", "tbody", "tr", "th", "td"),
    }
    groups, skipped = parsed.tables
    assert groups["rows"][1][:3] == [HOSTILE, HOSTILE, HOSTILE]  # shown as they are
    assert skipped["rows"][1] == [HOSTILE, "7", HOSTILE]
    assert all(len(attrs) <= 2 for _, attrs in parsed.tags)  # no attribute injected
