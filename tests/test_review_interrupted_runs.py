"""Interrupted Spark runs into the same `--out` every night (review: interrupted runs).

An operator's cron runs `pushgw spark run ... --out DIR` into one directory; a run may
be killed (OOM killer, scheduler timeout), interrupted, or fail half-way. Then:

- `result-<job>.json` is the completion marker: removed before the job writes anything
  and written last, so a half-written directory, or one mixed with the previous run's
  files, never holds a marker that vouches for it;
- SIGTERM and Ctrl-C say which job's outputs are incomplete, with a non-zero status;
- `pushgw tokens retire` refuses a `dead-tokens.jsonl` whose marker says it should hold
  more (or fewer) tokens, and retires nothing;
- the next run recovers: no `_temporary`, `.parts` or `.tmp` left, only its own numbers.

Processes are killed at a point they announce on stderr (the job's progress lines), not
after a sleep.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main as pushgw
from spark_plugins import render, runner, synthetic
from spark_plugins.builtin import BUILTIN_JOBS
from spark_plugins.session import spark_problem
from tests.conftest import offline_apns_app

pytestmark = pytest.mark.spark

JOBS = {job.name: job for job in BUILTIN_JOBS}
QUIET = ["--conf", "spark.ui.showConsoleProgress=false", "--master", "local[2]"]
LEFTOVERS = ("_temporary", ".parts", ".tmp")


def _need_spark() -> None:
    problem = spark_problem()
    if problem:
        pytest.skip(f"needs pyspark and Java 17: {problem}")


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    _need_spark()
    from spark_plugins.session import get_session

    yield get_session(
        "local[2]",
        app_name="pushgw-interrupted-runs",
        conf={"spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "4"},
    )


def _receipts(directory: Path, n: int, seed: int) -> Path:
    items = list(synthetic.receipts(n, seed=seed, tokens=50))
    synthetic.write_with_receipt_writer(items, directory)
    return directory


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "spark", "run", *args, *QUIET]


def _run_until(argv: list[str], cwd: Path, announce: str, sig: int) -> tuple[int, str]:
    """Run `argv`, send `sig` once a stderr line holds `announce`; (status, stderr)."""
    proc = subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if announce in line:
            proc.send_signal(sig)
            break
    else:
        proc.wait()
        raise AssertionError(f"never announced {announce!r}: {''.join(seen)[-2000:]}")
    seen.append(proc.stderr.read())
    return proc.wait(), "".join(seen)


def _leftovers(out: Path) -> list[str]:
    return sorted(
        str(path.relative_to(out))
        for path in out.rglob("*")
        if any(mark in path.name for mark in LEFTOVERS)
    )


def _csv_total(path: Path) -> int:
    with path.open(newline="") as fh:
        return sum(int(row["total"]) for row in csv.DictReader(fh))


@pytest.mark.slow
def test_a_killed_run_leaves_no_marker_and_the_next_run_recovers(tmp_path: Path) -> None:
    """Last night's complete run, then tonight's killed (SIGKILL: the OOM killer) once
    the report has written its hourly table: hourly.csv is tonight's while reasons.csv,
    the page and the rest are last night's. Last night's marker stayed and vouched for
    that mix. The job's marker is gone; the next job's (not started) is still last
    night's, with its own outputs. The next complete run counts its receipts only."""
    _need_spark()
    _receipts(tmp_path / "night1", 1500, seed=1)
    _receipts(tmp_path / "night2", 400, seed=2)
    out = tmp_path / "out"
    jobs = ["delivery-report", "dead-tokens"]
    first = subprocess.run(
        _cli(*jobs, "--receipts", "night1", "--out", "out"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    before = {name: (out / name).read_bytes() for name in ("hourly.csv", "reasons.csv")}
    dead_marker = (out / "result-dead-tokens.json").read_bytes()

    argv = _cli(*jobs, "--receipts", "night2", "--out", "out")
    status, _ = _run_until(argv, tmp_path, "wrote hourly", signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert (out / "hourly.csv").read_bytes() != before["hourly.csv"]  # a mixed directory
    assert not (out / "result-delivery-report.json").exists()
    # the job not started keeps its consistent pair: last night's file and marker
    assert (out / "result-dead-tokens.json").read_bytes() == dead_marker

    again = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    result = json.loads((out / "result-delivery-report.json").read_text())
    assert result["metrics"]["receipts"] == 400
    assert _csv_total(out / "summary.csv") == _csv_total(out / "hourly.csv") == 400
    assert (out / "reasons.csv").read_bytes() != before["reasons.csv"]
    assert _leftovers(out) == []
    dead = json.loads((out / "result-dead-tokens.json").read_text())
    assert dead["input"]["records"] == 400


@pytest.mark.slow
def test_sigterm_says_which_outputs_are_incomplete(tmp_path: Path) -> None:
    """A scheduler's timeout (SIGTERM) mid-report: one line names the job whose outputs
    are not a complete run and the jobs never started; status 143, as a shell reports."""
    _need_spark()
    _receipts(tmp_path / "r", 600, seed=3)
    out = tmp_path / "out"
    out.mkdir()
    stale = {"job": "delivery-report", "metrics": {"receipts": 99}}
    (out / "result-delivery-report.json").write_text(json.dumps(stale))
    argv = _cli("delivery-report", "dead-tokens", "--receipts", "r", "--out", "out")
    status, err = _run_until(argv, tmp_path, "aggregated the receipts", signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, err[-2000:]
    assert (
        "pushgw spark: terminated (SIGTERM) during delivery-report: its outputs in out are "
        "not a complete run (no result-delivery-report.json); not run: dead-tokens\n"
    ) in err
    assert not (out / "result-delivery-report.json").exists()
    assert not (out / "dead-tokens.jsonl").exists()


def test_a_job_failing_half_way_leaves_no_marker(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tables are written, then the job fails (status 1): the earlier run's marker
    would have vouched for tonight's tables beside its own chart and page."""
    old = _receipts(tmp_path / "old", 300, seed=4)
    new = _receipts(tmp_path / "new", 200, seed=5)
    out = tmp_path / "out"
    job = [JOBS["delivery-report"]]
    status, _ = runner.run_jobs(job, str(old), str(out), master="local[2]", stop=False)
    assert status == 0 and (out / "result-delivery-report.json").exists()

    def broken_chart(hourly: Any) -> bytes:
        raise RuntimeError("the chart broke")

    monkeypatch.setattr(render, "chart_png", broken_chart)
    capsys.readouterr()
    status, results = runner.run_jobs(job, str(new), str(out), master="local[2]", stop=False)
    assert (status, results) == (1, [])
    assert "pushgw spark: delivery-report failed: the chart broke" in capsys.readouterr().err
    assert _csv_total(out / "summary.csv") == 200  # tonight's table, beside last night's page
    assert not (out / "result-delivery-report.json").exists()


def test_ctrl_c_names_the_incomplete_job(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C inside a job: the line says which outputs are incomplete and what did not
    run; the interrupt goes on (the command's status 130) and no marker is left."""
    receipts = _receipts(tmp_path / "r", 50, seed=6)
    out = tmp_path / "out"
    out.mkdir()
    (out / "result-per-app.json").write_text("{}")  # an earlier run's

    def run(spark: Any, receipts_dir: str, out_dir: str, options: Any) -> Any:
        (Path(out_dir) / "per-app.csv").write_text("app_id,count\n")
        raise KeyboardInterrupt

    from spark_plugins import SparkJob

    jobs = [SparkJob("per-app", "x", run, ()), JOBS["volume-anomalies"]]
    with pytest.raises(KeyboardInterrupt):
        runner.run_jobs(jobs, str(receipts), str(out), master="local[2]", stop=False)
    assert capsys.readouterr().err == (
        f"pushgw spark: interrupted during per-app: its outputs in {out} are not a complete "
        "run (no result-per-app.json); not run: volume-anomalies\n"
    )
    assert not (out / "result-per-app.json").exists()
    assert not (out / "result-volume-anomalies.json").exists()


@pytest.fixture
def dead_run(spark: Any, tmp_path: Path) -> Path:
    """A real dead-tokens run's output directory, with tokens to retire."""
    receipts = _receipts(tmp_path / "r", 3000, seed=1)
    out = tmp_path / "out"
    status, (result,) = runner.run_jobs(
        [JOBS["dead-tokens"]], str(receipts), str(out), master="local[2]", stop=False
    )
    assert status == 0 and result.metrics["tokens_retired"] >= 3
    return out


def _retire_config(tmp_path: Path) -> Path:
    path = tmp_path / "pushgw.yaml"
    app = offline_apns_app(tmp_path)
    config = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "plugins": {"enabled": ["matrix"], "matrix": {"apps": {"im.vector.app.ios": app}}},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("cut", ["last line", "all lines"])
def test_retire_refuses_a_dead_token_file_cut_at_a_line_end(
    dead_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], cut: str
) -> None:
    """A copy cut short at a line end is valid JSON Lines: before, `tokens retire`
    retired the lines it got (or, emptied, nothing at all, status 0). Beside the job's
    marker it is refused, with status 2, and nothing is retired."""
    dead = dead_run / "dead-tokens.jsonl"
    lines = dead.read_bytes().splitlines(keepends=True)
    kept = lines[:-1] if cut == "last line" else []
    dead.write_bytes(b"".join(kept))
    config = _retire_config(tmp_path)
    capsys.readouterr()
    assert pushgw(["tokens", "retire", str(dead), "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"pushgw: error: {dead}: holds {len(kept)} token{'s' if len(kept) != 1 else ''}, "
        f"but result-dead-tokens.json beside it says the dead-tokens run wrote {len(lines)}: "
        "the file is incomplete or was changed; nothing was retired\n"
    )
    assert not (tmp_path / "db.sqlite").exists()  # the database was never opened


def test_retire_takes_the_complete_file_of_a_finished_run(
    dead_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = dead_run / "dead-tokens.jsonl"
    rows = [json.loads(line) for line in dead.read_text().splitlines()]
    ours = sum(1 for r in rows if (r["plugin"], r["app_id"]) == ("matrix", "im.vector.app.ios"))
    assert 0 < ours < len(rows)
    config = _retire_config(tmp_path)
    capsys.readouterr()
    assert pushgw(["tokens", "retire", str(dead), "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"retired {ours} token{'s' if ours != 1 else ''} in "), out
    # a renamed copy has no marker to compare with: read as any dead-token file
    copy = tmp_path / "dead.jsonl"
    copy.write_bytes(b"".join(dead.read_bytes().splitlines(keepends=True)[:1]))
    assert pushgw(["tokens", "retire", str(copy), "--config", str(config)]) == 0
    assert os.path.exists(tmp_path / "db.sqlite")
