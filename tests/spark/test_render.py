"""The delivery report's chart is drawn whatever numbers the hourly rows hold."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spark_plugins import render
from spark_plugins.jobs import JobResult
from spark_plugins.reader import LATENCY_MS_MAX, TS_MAX, TS_MIN
from tests.spark.conftest import START

PNG = b"\x89PNG\r\n\x1a\n"
H = 3600
ROOT = Path(__file__).resolve().parents[2]


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


def _fresh_python(code: str, extra_path: str | None = None) -> subprocess.CompletedProcess[str]:
    """`code` in a new interpreter (matplotlib not imported yet), from the project root."""
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_chart_drawn_while_matplotlib_preloads_is_whole() -> None:
    """The job imports matplotlib in the background; the chart may be asked for at once."""
    done = _fresh_python(
        "import sys\n"
        "from spark_plugins import render\n"
        "render.preload()\n"
        "png = render.chart_png([{'hour': 1700000000, 'total': 3, 'ok': 2,"
        " 'success_rate': 2 / 3, 'latency_p50': 1.0, 'latency_p95': 2.0,"
        " 'latency_p99': 3.0}])\n"
        "sys.stdout.write(png[:8].hex())\n"
    )
    assert done.returncode == 0, done.stderr
    assert bytes.fromhex(done.stdout) == PNG
    assert "Traceback" not in done.stderr


def test_a_failed_preload_is_silent_and_the_chart_reports_it(tmp_path: Path) -> None:
    """No stray thread traceback: the error comes from chart_png, where the job reports it."""
    broken = tmp_path / "matplotlib"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('matplotlib is broken here')\n")
    done = _fresh_python(
        "import threading\n"
        "from spark_plugins import render\n"
        "render.preload()\n"
        "for thread in threading.enumerate():\n"
        "    if thread.name == 'pushgw-matplotlib':\n"
        "        thread.join()\n"
        "try:\n"
        "    render.chart_png([])\n"
        "except ImportError as error:\n"
        "    print('chart_png:', error)\n",
        extra_path=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "chart_png: matplotlib is broken here"
    assert done.stderr == ""
