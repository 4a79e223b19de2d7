"""The built-in jobs on a real Spark standalone cluster, against the same jobs in local mode.

What local mode cannot show: executors in their own JVMs and working directories, with
no Python at all (`spark.pyspark.python` names a file that does not exist, so a Python
UDF would fail the job), and relative `--receipts` / `--out` resolved by the driver.
It also covers `run_job.py` with several jobs and options routed to one job or to all,
and `pushgw spark run --master URL`, the driver in the operator's own process.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_plugins import synthetic
from spark_plugins.runner import discover_jobs, resolve_job_options
from spark_plugins.session import spark_problem
from spark_plugins.testing import (
    StandaloneCluster,
    spark_submit_binary,
    standalone_cluster,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOBS = ("delivery-report", "dead-tokens", "volume-anomalies")
# one job's option, another job's option given with its job name, and one all jobs take
OPTIONS = ("min_span_hours=0", "delivery-report:chart=false", "max_bad_lines=2")
TABLES = ("summary.csv", "reasons.csv", "hourly.csv", "volume.csv", "anomalies.csv")
BAD_LINES = (
    '{"v": 1, "ts": 1735689600.5, "push_id": "cut-',  # truncated
    "not json",
    '{"v": 2, "ts": 1735689600.5}',  # a schema version this reader does not know
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    problem = spark_problem()
    if problem:
        pytest.skip(f"needs pyspark and Java 17: {problem}")
    work = tmp_path_factory.mktemp("spark-work")
    with standalone_cluster(cores=2, memory="1g", work_dir=work) as running:
        yield running


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _same_cell(a: str, b: str) -> bool:
    """Equal, or the same float up to summation order (partitioning differs)."""
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    except ValueError:
        return False


def _assert_same_table(cluster_csv: Path, local_csv: Path) -> None:
    got, want = _rows(cluster_csv), _rows(local_csv)
    assert len(got) == len(want), cluster_csv.name
    for row, expected in zip(got, want, strict=True):
        assert row.keys() == expected.keys(), cluster_csv.name
        differing = [k for k in row if not _same_cell(row[k], expected[k])]
        assert not differing, (cluster_csv.name, differing, row, expected)


def _input_report(out: Path, job: str) -> dict[str, Any]:
    result = json.loads((out / f"result-{job}.json").read_text())
    return dict(result["input"])


def test_jobs_on_a_standalone_cluster_match_local_mode(
    cluster: StandaloneCluster, spark: Any, tmp_path: Path
) -> None:
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(800, seed=3, tokens=25)), receipts)
    with sorted(receipts.rglob("*.jsonl"))[0].open("a") as fh:
        fh.write("".join(line + "\n" for line in BAD_LINES))  # skipped, located by executors
    launched_before = cluster.executors_launched

    from spark_plugins.submit import DIR

    command = [spark_submit_binary(), "--master", cluster.master_url]
    command += ["--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=4"]
    command += ["--conf", f"spark.pyspark.driver.python={sys.executable}"]
    command += ["--conf", "spark.pyspark.python=/nonexistent/python"]  # executors: no Python
    command += [f"{DIR}/run_job.py", *JOBS, *[f"--option={o}" for o in OPTIONS]]
    command += ["--receipts", "receipts", "--out", "out"]  # relative to the driver's cwd
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cluster.executors_launched > launched_before, cluster.worker_log()[-20:]
    finished = [proc.stdout.index(f"{name}: 800 receipts") for name in JOBS]
    assert finished == sorted(finished), proc.stdout  # in the order given

    # The same jobs in local mode, in this process.
    local = tmp_path / "local"
    jobs = discover_jobs()
    chosen = [jobs[name] for name in JOBS]
    options = resolve_job_options(chosen, OPTIONS)
    for job in chosen:
        job.run(spark, str(receipts), str(local), options[job.name])

    out = tmp_path / "out"
    for table in TABLES:
        _assert_same_table(out / table, local / table)
    for name in JOBS:
        got, want = _input_report(out, name), _input_report(local, name)
        assert got == want, name
        assert (got["records"], got["bad"], len(got["bad_lines"])) == (800, 3, 2), got
    dead = (out / "dead-tokens.jsonl").read_text().splitlines()
    assert sorted(dead) == sorted((local / "dead-tokens.jsonl").read_text().splitlines())
    assert dead, "the sample has tokens to retire"
    assert not (out / "chart.png").exists()  # chart=false reached delivery-report


def test_pushgw_spark_run_with_master_uses_the_cluster(
    cluster: StandaloneCluster, spark: Any, tmp_path: Path
) -> None:
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(600, seed=5, tokens=20)), receipts)
    launched_before = cluster.executors_launched

    command = [sys.executable, "-m", "gateway.cli", "spark", "run", "delivery-report"]
    command += ["--master", cluster.master_url, "--receipts", "receipts", "--out", "out"]
    command += ["--option", "chart=false"]
    for conf in (
        "spark.pyspark.python=/nonexistent/python",  # executors: no Python
        "spark.driver.host=127.0.0.1",  # where the executors reach this driver
        "spark.sql.shuffle.partitions=4",
        "spark.ui.enabled=false",
    ):
        command += ["--conf", conf]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cluster.executors_launched > launched_before, cluster.worker_log()[-20:]

    local = tmp_path / "local"
    job = discover_jobs()["delivery-report"]
    job.run(spark, str(receipts), str(local), resolve_job_options([job], ["chart=false"])[job.name])
    for table in ("summary.csv", "reasons.csv", "hourly.csv"):
        _assert_same_table(tmp_path / "out" / table, local / table)
    assert _input_report(tmp_path / "out", job.name)["records"] == 600
