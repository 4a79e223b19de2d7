"""Review from the seat of an operator whose machines run an unusual time zone
(Pacific/Chatham, UTC+12:45 / +13:45 in summer) or the ASCII C locale (LC_ALL=C).

What depends on process start (the locale a JVM is launched under) runs in a real
subprocess with the environment overridden; the rest in process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.core.push import Outcome
from spark_plugins import synthetic
from spark_plugins.session import spark_problem
from tests.conftest import configured_logging
from tests.spark.conftest import START, receipt

PUSHGW = [sys.executable, "-m", "gateway.cli"]


@pytest.fixture
def chatham(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's local time zone is Pacific/Chatham (UTC+13:45 on 1 January)."""
    monkeypatch.setenv("TZ", "Pacific/Chatham")
    time.tzset()
    assert time.localtime(START).tm_hour == 13  # the zone exists here: 00:00Z is 13:45
    yield
    monkeypatch.undo()
    time.tzset()


def test_plain_log_lines_carry_utc_times_whatever_the_machines_zone(chatham: None) -> None:
    """`pushgw serve` without `logging.json`: a line's time is the UTC instant, marked
    as such, as the JSON lines, receipts and reports have it (it was the local wall clock
    with no offset: 13:45 ahead here, and unmarked)."""
    with configured_logging("INFO"):
        handler = logging.getLogger().handlers[0]
        record = logging.LogRecord("gateway.test", logging.INFO, __file__, 1, "hello", (), None)
        record.created, record.msecs = START + 0.25, 250.0
        record.request_id = "-"
        line = handler.format(record)
    assert line.startswith("2025-01-01T00:00:00.250Z INFO gateway.test [-] hello"), line


def test_json_log_lines_carry_utc_times_whatever_the_machines_zone(chatham: None) -> None:
    """Pinned (already right): the JSON lines' `ts` is UTC."""
    from gateway.logs import JsonFormatter

    record = logging.LogRecord("gateway.test", logging.INFO, __file__, 1, "hello", (), None)
    record.created, record.msecs = START + 0.25, 250.0
    assert '"ts":"2025-01-01T00:00:00.250Z"' in JsonFormatter().format(record)


@pytest.mark.spark
@pytest.mark.slow
def test_spark_run_under_lc_all_c_reads_and_writes_non_ascii_paths(tmp_path: Path) -> None:
    """`LC_ALL=C pushgw spark run` with a receipts and an output directory named with a
    non-ASCII letter: Java 17 encoded file names in ASCII under that locale, so Spark said
    the receipts directory Python had just found "does not exist". The report comes out,
    and a non-ASCII app id in it intact."""
    problem = spark_problem()
    if problem:
        pytest.skip(f"needs pyspark and Java 17: {problem}")
    receipts = tmp_path / "réceipts"
    items = [
        receipt(START + i * 60, Outcome.OK, token=f"t{i}", app_id="com.exämple.ios")
        for i in range(20)
    ]
    synthetic.write_with_receipt_writer(items, receipts)
    out = tmp_path / "rapports-été"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUTF8", "PYTHONIOENCODING")}
    env.update(LC_ALL="C", LANG="C", TZ="Pacific/Chatham")
    command = [*PUSHGW, "spark", "run", "delivery-report", "--master", "local[1]"]
    command += ["--option", "chart=false", "--receipts", str(receipts), "--out", str(out)]
    proc = subprocess.run(
        command, capture_output=True, env=env, timeout=300, check=False, cwd=tmp_path
    )
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, stderr[-3000:]
    summary = (out / "summary.csv").read_text(encoding="utf-8").splitlines()
    assert summary[1].startswith("2025-01-01T00:00:00Z,matrix,apns,com.exämple.ios,20,"), summary
