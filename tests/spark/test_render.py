"""The delivery report's chart is drawn whatever numbers the hourly rows hold."""

from __future__ import annotations

import math
from typing import Any

import pytest

from spark_plugins import render
from spark_plugins.jobs import JobResult
from spark_plugins.reader import LATENCY_MS_MAX, TS_MAX, TS_MIN
from tests.spark.conftest import START

PNG = b"\x89PNG\r\n\x1a\n"
H = 3600


def _row(hour: Any = START, **changes: Any) -> dict[str, Any]:
    """An hourly row as the job collects it (epoch seconds), with some values changed."""
    row = {
        "hour": hour,
        "total": 10,
        "ok": 9,
        "success_rate": 0.9,
        "latency_p50": 40.0,
        "latency_p95": 80.0,
        "latency_p99": 120.0,
        "latency_mean": 45.0,
        "latency_max": 130.0,
    }
    return {**row, **changes}


LATENCIES = ("latency_p50", "latency_p95", "latency_p99", "latency_mean", "latency_max")
CASES = {
    # what matplotlib cannot scale: "arange: cannot compute length", an OverflowError
    "latency 1.7e308": [_row(**dict.fromkeys(LATENCIES, 1.7e308)), _row(START + H)],
    "latencies -1.7e308 to 1.7e308": [_row(latency_p50=-1.7e308, latency_p99=1.7e308)],
    "total 1.7e308": [_row(total=1.7e308, ok=1e308), _row(START + H)],
    "count beyond a double": [_row(total=2**1100, ok=2**1100)],
    # the largest values the job can give, and gaps
    "the largest allowed": [
        _row(total=2**63 - 1, ok=2**62, **dict.fromkeys(LATENCIES, LATENCY_MS_MAX)),
        _row(START + H),
    ],
    "NaN, None and infinities": [
        _row(latency_p50=math.nan, latency_p95=None, latency_p99=math.inf),
        _row(START + H, total=None, ok=math.nan, success_rate=-math.inf),
        _row(START + 2 * H, **dict.fromkeys(LATENCIES)),
    ],
    "no latency at all": [_row(**dict.fromkeys(LATENCIES)), _row(START + H, total=0, ok=0)],
    # hours: 2000 to 2099 as receipts have them; anything else is left out
    "hours of a century": [_row(TS_MIN), _row(TS_MAX - H)],
    "hours no receipt has": [
        _row(None),
        _row(math.nan),
        _row(1e20),
        _row(-62135596800),  # year 1: matplotlib's date axis fails near it
        _row(START),
    ],
    "no hour to plot": [_row(None), _row(math.inf)],
}


@pytest.mark.parametrize("rows", list(CASES.values()), ids=list(CASES))
def test_chart_is_drawn_whatever_the_numbers(rows: list[dict[str, Any]]) -> None:
    assert render.chart_png(rows)[:8] == PNG


def test_plotted_values_are_clipped_or_gaps() -> None:
    assert render._plotted(1.7e308) == render.PLOT_LIMIT
    assert render._plotted(-(2**1100)) == -render.PLOT_LIMIT  # an int beyond a double
    assert math.isnan(render._plotted(None)) and math.isnan(render._plotted(math.inf))
    assert render._plotted(0.25, 100) == 25.0
    assert render._plotted(LATENCY_MS_MAX) == LATENCY_MS_MAX  # real values as they are
    assert render._plotted(2**63 - 1) == float(2**63 - 1)


@pytest.mark.parametrize("groups", [render.MAX_PAGE_GROUPS, render.MAX_PAGE_GROUPS + 1])
def test_the_page_says_when_its_group_table_is_cut(groups: int) -> None:
    summary = [
        {
            "plugin": "p",
            "provider": "fcm",
            "app_id": f"app{i:04d}",
            "total": 1 + i,
            "ok": 1,
            "retries": 0,
            "latency_p99": 5.0,
        }
        for i in range(groups)
    ]
    page = render.report_html([], summary, JobResult("delivery-report"), b"").decode()
    rows = page.count("<td>app")
    assert rows == render.MAX_PAGE_GROUPS
    cut = f"The {render.MAX_PAGE_GROUPS} largest of {groups} groups by volume"
    assert (cut in page) == (groups > render.MAX_PAGE_GROUPS)
    assert "app0000" not in page or groups == render.MAX_PAGE_GROUPS  # the smallest goes
