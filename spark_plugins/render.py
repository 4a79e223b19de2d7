"""The delivery report's chart (PNG, matplotlib) and self-contained HTML page."""

from __future__ import annotations

import atexit
import base64
import contextlib
import html
import io
import math
import os
import shutil
import tempfile
import threading
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from spark_plugins.reader import TS_MAX, TS_MIN

if TYPE_CHECKING:
    from spark_plugins.jobs import JobResult


# The largest magnitude plotted: matplotlib's autoscaling and tick locators overflow on
# values near the largest double (1.7e308: "arange: cannot compute length"). Far above
# any count (a long is at most 9.2e18) or latency (30 days, reader.LATENCY_MS_MAX) of a
# report, so only garbage is ever clipped.
PLOT_LIMIT = 1e300


def _hour(value: Any) -> datetime | None:
    """The hour of an hourly row (epoch seconds), or None when no receipt can have it
    (`reader.TS_MIN` to `TS_MAX`): matplotlib's date axis fails on years far out."""
    try:
        seconds = value.timestamp() if isinstance(value, datetime) else float(value)
    except (TypeError, ValueError, OverflowError):  # None, or an int beyond a double
        return None
    if not TS_MIN <= seconds < TS_MAX:  # NaN too
        return None
    return datetime.fromtimestamp(seconds, tz=UTC)


def _plotted(value: Any, scale: float = 1.0) -> float:
    """A value as drawn: None and anything not finite is a gap (NaN, which matplotlib
    skips), a finite value is clipped to +-PLOT_LIMIT."""
    try:
        number = float(value)
    except OverflowError:  # an int beyond a double: finite, clipped like one
        number = PLOT_LIMIT if value > 0 else -PLOT_LIMIT
    except (TypeError, ValueError):  # None
        return math.nan
    number *= scale
    if not math.isfinite(number):
        return math.nan
    return max(-PLOT_LIMIT, min(PLOT_LIMIT, number))


def _col(rows: list[dict[str, Any]], name: str, scale: float = 1.0) -> list[float]:
    return [_plotted(r.get(name), scale) for r in rows]


_ONE_HOUR = timedelta(hours=1)


def _broken_at_gaps(
    hours: list[datetime], values: list[float]
) -> tuple[list[datetime], list[float]]:
    """A line's points with a gap (NaN, which matplotlib does not join) after each hour
    whose next row is more than an hour later: hours without receipts have no row, and
    a line drawn straight across them would show values those hours never had."""
    xs: list[datetime] = []
    ys: list[float] = []
    for i, (hour, value) in enumerate(zip(hours, values, strict=True)):
        xs.append(hour)
        ys.append(value)
        if i + 1 < len(hours) and hours[i + 1] - hour > _ONE_HOUR:
            xs.append(hour + _ONE_HOUR)
            ys.append(math.nan)
    return xs, ys


# Legends beside the panels, not inside them: inside, they hid the first hours' bars
# and points (a single hour's p95 and p99 entirely).
_LEGEND: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.005, 1.0)}

# Every series is told apart by more than its colour (WCAG 1.4.1): the latency lines by
# marker and dash, "not ok" bars by a hatch. Each colour has 3:1 contrast or more against
# the white panels (WCAG 1.4.11; matplotlib's orange, #ff7f0e, had 2.5:1).
_OK = "#4c9a2a"
_NOT_OK: dict[str, Any] = {"color": "#c0392b", "hatch": "///", "edgecolor": "white"}
_LATENCY_STYLES: dict[str, dict[str, Any]] = {
    "latency_p50": {"color": "#2ca02c", "marker": "o", "linestyle": "solid"},
    "latency_p95": {"color": "#c45a00", "marker": "s", "linestyle": "dashed"},
    "latency_p99": {"color": "#d62728", "marker": "^", "linestyle": "dotted"},
}


def _writable_matplotlib_dir() -> None:
    """Point matplotlib at a temporary directory of ours when its own is not writable.

    Its config and font-cache directory is MPLCONFIGDIR, else ~/.config/matplotlib. With
    an unset or read-only HOME (a hardened container) matplotlib makes a temporary one
    itself, but warns twice per run; an operator silences that, and keeps the font cache
    from one run to the next, by setting MPLCONFIGDIR (docs/spark.md).
    """
    if os.environ.get("MPLCONFIGDIR"):
        return
    home = os.path.expanduser("~")
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    if os.path.isabs(base):  # not "~/.config" when no home directory is known
        try:
            os.makedirs(os.path.join(base, "matplotlib"), exist_ok=True)
            if os.access(os.path.join(base, "matplotlib"), os.W_OK):
                return
        except OSError:
            pass
    scratch = tempfile.mkdtemp(prefix="pushgw-matplotlib-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    os.environ["MPLCONFIGDIR"] = scratch


_PYPLOT_LOCK = threading.Lock()


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend. Under a lock: `preload` may still be
    importing it in the background when the chart is drawn."""
    with _PYPLOT_LOCK:
        _writable_matplotlib_dir()
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt


def preload() -> None:
    """Import matplotlib in a background thread while Spark aggregates.

    The import takes about half a second, which a report otherwise spends after the
    aggregation, waiting; the driver's Python is idle meanwhile (the JVM works). A failed
    import is left for `chart_png` to raise, in the job's own thread and error report.
    """

    def load() -> None:
        with contextlib.suppress(Exception):  # chart_png raises it again, and reports it
            _pyplot()

    threading.Thread(target=load, name="pushgw-matplotlib", daemon=True).start()


def chart_png(hourly: list[dict[str, Any]]) -> bytes:
    """Three panels over time: volume (ok / failed), success rate, latency p50/p95/p99."""
    plt = _pyplot()
    fig, (vol, rate, lat) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    placed = [(hour, r) for r in hourly if (hour := _hour(r.get("hour"))) is not None]
    placed.sort(key=lambda hour_row: hour_row[0])
    if placed:
        hours = [hour for hour, _ in placed]
        rows = [r for _, r in placed]
        ok = _col(rows, "ok")
        failed = [_plotted(t - o) for t, o in zip(_col(rows, "total"), ok, strict=True)]
        # One hour wide from the hour's start (a bar covers its hour), no edge, no
        # antialiasing: hundreds of bars a few pixels wide otherwise show irregular white
        # seams between them.
        bars = {"width": 1 / 24, "align": "edge", "linewidth": 0, "antialiased": False}
        vol.bar(hours, ok, color=_OK, label="ok", **bars)
        # hatched: red and green alone are one colour to many readers and to a grey print
        vol.bar(hours, failed, bottom=ok, label="not ok", **_NOT_OK, **bars)
        vol.legend(**_LEGEND)
        rate.plot(
            *_broken_at_gaps(hours, _col(rows, "success_rate", 100)), marker=".", color="#1f77b4"
        )
        rate.set_ylim(0, 101)
        for column, style in _LATENCY_STYLES.items():
            lat.plot(
                *_broken_at_gaps(hours, _col(rows, column)),
                markersize=4,
                label=column.removeprefix("latency_"),
                **style,
            )
        lat.legend(**_LEGEND)
    else:
        empty = "no hours to plot" if hourly else "no receipts"
        vol.text(0.5, 0.5, empty, ha="center", va="center", transform=vol.transAxes)
    vol.set_ylabel("pushes / hour")
    vol.set_title("Delivery volume (UTC hours)")
    rate.set_ylabel("success rate (%)")
    lat.set_ylabel("latency (ms)")
    lat.set_xlabel("hour (UTC)")
    for ax in (vol, rate, lat):
        ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def _table(caption: str, headers: list[str], rows: list[list[Any]]) -> str:
    """A table a screen reader announces by its caption, its header cells as column
    headers."""
    head = "".join(f'<th scope="col">{html.escape(h)}</th>' for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return (
        f"<table><caption>{html.escape(caption)}</caption>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:  # NaN
            return ""
        # 4 significant digits below 1000 (0.9123, 45.67), whole numbers from there on:
        # a p99 of 12,346 ms, not "1.235e+04"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"  # 1,234,567 pushes, read at a glance like the latencies
    return str(value)


def _count(n: Any, noun: str) -> str:
    """ "1 hour", "3 hours", "1,234 receipts"."""
    return f"{_fmt(n)} {noun}" if n == 1 else f"{_fmt(n)} {noun}s"


def _percent(rate: Any) -> str:
    """A success rate (0 to 1) as a percentage, "98.37%", with as many more decimals as
    it takes for a rate below 1 not to read "100.00%" (nor one above 0 "0.00%"): at a
    million pushes a day, 40 failures are 99.996%, which 4 significant digits made "1"."""
    if rate is None or not math.isfinite(rate):
        return ""
    if not 0 < rate < 1:  # none or all ok (or garbage): no decimals to keep
        return f"{rate * 100:.0f}%"
    for decimals in range(2, 16):
        text = f"{rate * 100:.{decimals}f}"
        if 0 < float(text) < 100:
            break
    return f"{text}%"


def _period(hourly: list[dict[str, Any]]) -> str:
    """The hours the rows cover, for the page: " between 2025-01-01 00:00 and
    2025-01-03 00:00 UTC" (start of the first hour, end of the last), or ""."""
    hours = [hour for r in hourly if (hour := _hour(r.get("hour"))) is not None]
    if not hours:
        return ""
    first, end = min(hours), max(hours) + _ONE_HOUR
    return f" between {first:%Y-%m-%d %H:%M} and {end:%Y-%m-%d %H:%M} UTC"


def _extreme(
    placed: list[tuple[datetime, dict[str, Any]]], column: str, pick: Any
) -> tuple[Any, datetime] | None:
    """The hourly value `pick` (min or max) chooses from a column, with its hour; None
    when no hour has a finite value."""
    values = [(r[column], hour) for hour, r in placed if math.isfinite(_plotted(r.get(column)))]
    return pick(values, key=lambda value_hour: value_hour[0]) if values else None


def chart_alt(hourly: list[dict[str, Any]]) -> str:
    """The chart in words, for a screen reader (the image's `alt`) and anyone who cannot
    read its small print: the hours it covers, the busiest hour, the hour of the lowest
    success rate and of the highest p99. The same size for one hour or thousands."""
    placed = [(hour, r) for r in hourly if (hour := _hour(r.get("hour"))) is not None]
    if not placed:
        return "Chart: no hours to plot." if hourly else "Chart: no receipts."
    text = f"Chart of {_count(len(placed), 'UTC hour')} with receipts{_period(hourly)}"
    parts = []
    for column, pick, words, shown in (
        ("total", max, "most pushes in an hour", _fmt),
        ("success_rate", min, "lowest success rate", _percent),
        ("latency_p99", max, "highest p99 latency", lambda v: f"{_fmt(_plotted(v))} ms"),
    ):
        found = _extreme(placed, column, pick)
        if found is not None:
            value, hour = found
            parts.append(f"{words} {shown(value)} at {hour:%Y-%m-%d %H:%M}")
    return f"{text}: {'; '.join(parts)}." if parts else f"{text}."


# The page runs no script and loads nothing (it travels as an e-mail attachment, opened
# offline): the browser is told so, so that a value from receipts that ever slipped past
# the escaping still could not run or call out. Only the inline style and the embedded
# chart are allowed.
PAGE_POLICY = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'"
)

MAX_PAGE_GROUPS = 200  # rows of the page's group table; summary.csv has every group
GROUP_HEADERS = [
    "plugin",
    "provider",
    "app",
    "pushes",
    "success rate",
    "retries",
    "worst hourly p99 (ms)",
]


def report_html(
    hourly: list[dict[str, Any]], summary: list[dict[str, Any]], result: JobResult, png: bytes
) -> bytes:
    """One HTML file with the chart embedded, totals per group, and skipped input."""
    totals: dict[tuple[Any, ...], list[Any]] = {}
    for r in summary:
        key = (r["plugin"], r["provider"] or "-", r["app_id"])
        t = totals.setdefault(key, [0, 0, 0, None])
        t[0] += r["total"]
        t[1] += r["ok"]
        t[2] += r["retries"] or 0
        # null in an hour when no push of the group was sent: a group that never sent
        # has no p99 (an empty cell, as in summary.csv), not 0 ms
        p99 = r["latency_p99"]
        if p99 is not None and (t[3] is None or p99 > t[3]):
            t[3] = p99
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:MAX_PAGE_GROUPS]
    shown = (
        ""
        if len(totals) <= MAX_PAGE_GROUPS
        else (
            f"<p>The {MAX_PAGE_GROUPS} largest of {_fmt(len(totals))} groups by volume; "
            "summary.csv has them all.</p>\n"
        )
    )
    groups = [[*key, t[0], _percent(t[1] / t[0]), t[2], t[3]] for key, t in ranked]
    table = (
        _table("Pushes per group, largest first", GROUP_HEADERS, groups)
        if groups
        else "<p>no receipts</p>"
    )
    metrics = result.metrics
    stats = result.input
    bad_rows = [
        # a line number as an editor shows it: 12345, not 12,345
        [b.file, str(b.line) if b.line is not None else "", b.text[:120]]
        for b in stats.bad_lines
    ]
    skipped = (
        _table(
            "Skipped lines: file, line number, first 120 characters",
            ["file", "line", "start of line"],
            bad_rows,
        )
        if bad_rows
        else ""
    )
    if not stats.listed_all:  # the listing stops at max_bad_lines (0: none listed)
        skipped += (
            f"<p>{_fmt(stats.bad)} skipped in {_fmt(len(stats.bad_files))} files in all; "
            f"{_fmt(len(bad_rows)) if bad_rows else 'none'} listed (option max_bad_lines).</p>"
        )
    image = base64.b64encode(png).decode()
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{PAGE_POLICY}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>pushgw delivery report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; background: #fff; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
caption {{ text-align: left; font-weight: bold; padding-bottom: 3px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f4f4f4; }}
td:nth-child(-n+3) {{ text-align: left; overflow-wrap: anywhere; }}
img {{ max-width: 100%; height: auto; background: #fff; }}
@media (max-width: 40em) {{ body {{ margin: 0.5em; }} }}
@media (prefers-color-scheme: dark) {{
  body {{ color: #e8e8e8; background: #121212; }}
  th {{ background: #2a2a2a; }} th, td {{ border-color: #555; }}
}}
@media print {{
  body {{ margin: 0; color: #000; background: #fff; }}
  th {{ background: #fff; }} img {{ break-inside: avoid; }}
}}
</style></head><body>
<h1>pushgw delivery report</h1>
<p>{_count(metrics.get("receipts"), "receipt")} in {_count(metrics.get("hours"), "hour")} with
receipts{_period(hourly)}, from {_count(stats.files, "file")}; success rate
{_percent(metrics.get("success_rate")) or "-"}; {_fmt(stats.bad)} bad lines skipped.</p>
<img alt="{html.escape(chart_alt(hourly))}" src="data:image/png;base64,{image}">
<h2>Per plugin, provider and app</h2>
{shown}{table}
<h2>Skipped receipt lines</h2>
{skipped or "<p>none</p>"}
<p>Hours are UTC, latencies in milliseconds. Tables: summary.csv, reasons.csv,
hourly.csv (and Parquet); see docs/spark.md.</p>
</body></html>
"""
    return page.encode()
