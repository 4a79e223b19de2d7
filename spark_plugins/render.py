"""The delivery report's chart (PNG, matplotlib) and self-contained HTML page."""

from __future__ import annotations

import base64
import html
import io
import math
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


def chart_png(hourly: list[dict[str, Any]]) -> bytes:
    """Three panels over time: volume (ok / failed), success rate, latency p50/p95/p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        vol.bar(hours, ok, color="#4c9a2a", label="ok", **bars)
        vol.bar(hours, failed, bottom=ok, color="#c0392b", label="not ok", **bars)
        vol.legend(**_LEGEND)
        rate.plot(
            *_broken_at_gaps(hours, _col(rows, "success_rate", 100)), marker=".", color="#1f77b4"
        )
        rate.set_ylim(0, 101)
        for column, colour in (
            ("latency_p50", "#2ca02c"),
            ("latency_p95", "#ff7f0e"),
            ("latency_p99", "#d62728"),
        ):
            lat.plot(
                *_broken_at_gaps(hours, _col(rows, column)),
                marker=".",
                color=colour,
                label=column.removeprefix("latency_"),
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


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:  # NaN
            return ""
        # 4 significant digits below 1000 (0.9123, 45.67), whole numbers from there on:
        # a p99 of 12,346 ms, not "1.235e+04"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _period(hourly: list[dict[str, Any]]) -> str:
    """The hours the rows cover, for the page: " between 2025-01-01 00:00 and
    2025-01-03 00:00 UTC" (start of the first hour, end of the last), or ""."""
    hours = [hour for r in hourly if (hour := _hour(r.get("hour"))) is not None]
    if not hours:
        return ""
    first, end = min(hours), max(hours) + _ONE_HOUR
    return f" between {first:%Y-%m-%d %H:%M} and {end:%Y-%m-%d %H:%M} UTC"


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
            f"<p>The {MAX_PAGE_GROUPS} largest of {len(totals)} groups by volume; "
            "summary.csv has them all.</p>\n"
        )
    )
    groups = [[*key, t[0], t[1] / t[0], t[2], t[3]] for key, t in ranked]
    metrics = result.metrics
    stats = result.input
    bad_rows = [
        [b.file, b.line if b.line is not None else "", b.text[:120]] for b in stats.bad_lines
    ]
    skipped = _table(["file", "line", "start of line"], bad_rows) if bad_rows else ""
    if stats.bad > len(bad_rows):  # the listing stops at max_bad_lines (0: none listed)
        skipped += (
            f"<p>{_fmt(stats.bad)} skipped in {_fmt(len(stats.bad_files))} files in all; "
            f"{_fmt(len(bad_rows)) if bad_rows else 'none'} listed (option max_bad_lines).</p>"
        )
    image = base64.b64encode(png).decode()
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pushgw delivery report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f4f4f4; }} td:nth-child(-n+3) {{ text-align: left; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>pushgw delivery report</h1>
<p>{_fmt(metrics.get("receipts"))} receipts in {_fmt(metrics.get("hours"))} hours with
receipts{_period(hourly)}, from {_fmt(stats.files)} files; success rate
{_fmt(metrics.get("success_rate")) or "-"}; {_fmt(stats.bad)} bad lines skipped.</p>
<img alt="volume, success rate and latency per hour" src="data:image/png;base64,{image}">
<h2>Per plugin, provider and app</h2>
{shown}{_table(GROUP_HEADERS, groups)}
<h2>Skipped receipt lines</h2>
{skipped or "<p>none</p>"}
<p>Hours are UTC, latencies in milliseconds. Tables: summary.csv, reasons.csv,
hourly.csv (and Parquet); see docs/spark.md.</p>
</body></html>
"""
    return page.encode()
