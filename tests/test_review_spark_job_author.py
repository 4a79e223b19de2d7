"""A third-party Spark job written from docs/spark.md ("Writing a job") only.

`weekly-digest` (per app per week: totals and the top failure reasons) is defined in
this file. Where the docs had its author copy private code or hit a wall, pushgw now
gives the piece to every job: its own `spark-submit` entry script (`submit_main`), the
skipped lines on stderr when it writes its own result file, progress lines as the
built-in jobs print them, and a clear failure when its `JobResult` names another job.
"""

from __future__ import annotations

import csv
import json
import time
import types
from pathlib import Path
from typing import Any

import pytest

from gateway.api import hookimpl
from spark_plugins import BadLine, InputStats, JobOption, JobResult, SparkJob, runner, synthetic
from spark_plugins.jobs import JAVA_INT_MAX
from tests.spark.conftest import spark  # noqa: F401 (the session's SparkSession)

NAME = "weekly-digest"
ENTRY = "digest_author"  # the entry point's name in `pushgw.plugins`


def run_digest(session: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
    """The job as docs/spark.md shows one, ending the way the built-in jobs end
    (`write_result` itself), and printing progress as they do."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from spark_plugins import progress
    from spark_plugins.output import ensure_dir, write_result, write_table
    from spark_plugins.reader import read_receipts

    started = time.monotonic()
    source = read_receipts(session, receipts_dir, max_reported=options["max_bad_lines"])
    progress(NAME, f"reading receipts from {receipts_dir}", started)
    weekly = source.df.withColumn("week", F.date_trunc("week", F.timestamp_seconds("ts")))
    reasons = (
        weekly.filter(F.col("status") != "ok")
        .groupBy("week", "app_id", F.coalesce("reason", "status").alias("reason"))
        .agg(F.count(F.lit(1)).alias("count"))
    )
    rank = Window.partitionBy("week", "app_id").orderBy(F.desc("count"), "reason")
    top = reasons.withColumn("rank", F.row_number().over(rank))
    top = top.filter(F.col("rank") <= options["top_reasons"])
    ensure_dir(session, out_dir)
    outputs, _ = write_table(top, out_dir, "weekly-reasons", ["week", "app_id", "rank"])
    progress(NAME, "wrote weekly-reasons", started)
    result = JobResult(NAME, outputs=outputs)
    result.input = source.stats()  # after the one action that read all of the input
    return write_result(session, out_dir, result, started)


DIGEST = SparkJob(
    NAME,
    "per app per week: totals and the top reasons",
    run_digest,
    (
        JobOption(
            "top_reasons", int, 3, "reasons per app and week", minimum=1, maximum=JAVA_INT_MAX
        ),
        JobOption("max_bad_lines", int, 100, "bad lines listed", minimum=0, maximum=JAVA_INT_MAX),
    ),
)


class DigestPlugin:
    """The plugin object its entry point names; `jobs` is what its hook returns."""

    jobs: list[SparkJob] = [DIGEST]

    @staticmethod
    @hookimpl
    def pushgw_spark_jobs() -> list[SparkJob]:
        return DigestPlugin.jobs


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution whose `pushgw.plugins` entry point is `DigestPlugin` above."""
    site = tmp_path / "site"
    dist_info = site / "pushgw_digest_author-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pushgw-digest-author\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[pushgw.plugins]\n{ENTRY} = {__name__}:DigestPlugin\n"
    )
    monkeypatch.syspath_prepend(str(site))


class _Spark:
    """Stands in for a SparkSession that no job here touches."""

    def stop(self) -> None:
        pass


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", lambda master=None, **kw: _Spark())


def test_a_plugins_own_submit_script_finds_its_job(
    installed: None,
    no_spark: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An entry script written as the built-in ones are (`submit_main("weekly-digest")`)
    ran nothing: "unknown job 'weekly-digest' (known: dead-tokens, delivery-report,
    volume-anomalies)", as if the plugin were not installed. It now finds the job
    through the entry point: its options are checked, and it runs."""
    receipts, out = tmp_path / "receipts", tmp_path / "out"
    receipts.mkdir()
    args = ["--receipts", str(receipts), "--out", str(out)]
    assert runner.submit_main(NAME, [*args, "--option", "top_reasons=0"]) == 2
    assert capsys.readouterr().err == (
        f"pushgw spark: job {NAME}: option top_reasons: must be >= 1, not 0\n"
    )
    assert not out.exists()  # a usage error writes nothing

    ran: list[dict[str, Any]] = []

    def record(session: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
        ran.append(dict(options))
        return JobResult(NAME)

    recording = SparkJob(NAME, DIGEST.description, record, DIGEST.options)
    monkeypatch.setattr(DigestPlugin, "jobs", [recording])
    assert runner.submit_main(NAME, [*args, "--option", "top_reasons=5"]) == 0
    assert ran == [{"top_reasons": 5, "max_bad_lines": 100}]
    assert json.loads((out / f"result-{NAME}.json").read_text())["job"] == NAME


def _stats(receipts: Path) -> InputStats:
    return InputStats(
        files=1,
        records=9,
        bad=1,
        bad_files=[str(receipts / "a.jsonl")],
        bad_lines=[BadLine(str(receipts / "a.jsonl"), 3, '{"v": 1, "ts": "soon"}')],
    )


def test_skipped_lines_are_printed_once_however_the_job_ends(
    no_spark: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job that ends as the built-in jobs do, `return write_result(...)`, had its
    skipped lines printed by nobody: the runner left such a job "as it is" and only the
    built-in jobs call `report_bad_input`. Each job's lines now reach stderr once: the
    runner prints those the job did not print, and never those it did."""
    from spark_plugins.output import write_result
    from spark_plugins.reader import report_bad_input

    receipts = tmp_path / "receipts"
    receipts.mkdir()

    def own_result(session: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
        result = JobResult("own-result", input=_stats(receipts))
        return write_result(session, out_dir, result, time.monotonic())

    def reports_too(session: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
        result = JobResult("reports-too", input=_stats(receipts))
        report_bad_input(result.input)
        return write_result(session, out_dir, result, time.monotonic())

    def plain(session: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
        return JobResult("plain", input=_stats(receipts))

    jobs = [SparkJob(f.__name__.replace("_", "-"), "", f) for f in (own_result, reports_too)]
    jobs.append(SparkJob("plain", "", plain))
    status, results = runner.run_jobs(jobs, str(receipts), str(tmp_path / "out"))
    assert status == 0 and len(results) == 3
    err = capsys.readouterr().err
    where = f"  {receipts / 'a.jsonl'}:3: "
    assert err.count("pushgw spark: skipped 1 bad receipt line(s) in 1 file(s):\n") == 3
    assert err.count(where) == 3, err


@pytest.mark.spark
def test_the_digest_runs_as_pushgw_spark_run_runs_it(
    installed: None,
    spark: Any,  # noqa: F811 (the session fixture)
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """End to end in the shared session: found by its entry point, options parsed, its
    tables, its result file, its progress lines, and its skipped line on stderr (which
    nobody printed before: the job writes its own result file)."""
    receipts = tmp_path / "receipts"
    items = list(synthetic.receipts(300, seed=5, tokens=20, hours=24 * 15))
    synthetic.write_with_receipt_writer(items, receipts)
    (receipts / "hand.jsonl").write_text('{"v": 1, "ts": "soon"}\n')
    out = tmp_path / "out"
    job = runner.discover_jobs()[NAME]
    status, (result,) = runner.run_jobs(
        [job], str(receipts), str(out), ["top_reasons=2"], master="local[2]", stop=False
    )
    assert status == 0
    assert (result.input.records, result.input.bad) == (300, 1)
    with (out / "weekly-reasons.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert rows and max(int(r["rank"]) for r in rows) <= 2
    failed = sum(1 for item in items if item.outcome.value != "ok")
    ranked_first = [r for r in rows if r["rank"] == "1"]
    assert 0 < sum(int(r["count"]) for r in ranked_first) <= failed
    written = json.loads((out / f"result-{NAME}.json").read_text())
    assert written["input"]["bad_lines"][0]["line"] == 1
    err = capsys.readouterr().err
    assert f"{receipts / 'hand.jsonl'}:1: " in err
    assert f"pushgw spark: {NAME}: [" in err and "] wrote weekly-reasons\n" in err


def test_progress_lines_are_the_built_in_jobs_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job's progress lines looked like the built-in jobs' only if its author copied
    `delivery_report._progress`; `spark_plugins.progress` is that one function now."""
    from spark_plugins import delivery_report, jobs, progress

    monkeypatch.setattr(jobs, "time", types.SimpleNamespace(monotonic=lambda: 112.34))
    progress(NAME, "wrote weekly-reasons", 100.0)
    progress(NAME, "reading receipts from r")
    delivery_report._progress("wrote summary", 100.0)
    assert capsys.readouterr().err == (
        f"pushgw spark: {NAME}: [  12.3s] wrote weekly-reasons\n"
        f"pushgw spark: {NAME}: reading receipts from r\n"
        "pushgw spark: delivery-report: [  12.3s] wrote summary\n"
    )


def test_a_result_named_for_another_job_fails_that_job(
    no_spark: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`JobResult("weekly_digest")` from the job `weekly-digest` (a typo) ran "fine":
    status 0, and its completion marker was `result-weekly_digest.json`, so that the
    `result-weekly-digest.json` a dashboard checks never appeared again. It is the job's
    contract broken: one line, status 1, no marker, and the next job still runs."""
    receipts, out = tmp_path / "receipts", tmp_path / "out"
    receipts.mkdir()

    def typo(session: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
        return JobResult("weekly_digest")

    def other(session: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
        return JobResult("other")

    jobs = [SparkJob(NAME, "", typo), SparkJob("other", "", other)]
    status, results = runner.run_jobs(jobs, str(receipts), str(out))
    assert status == 1
    assert [r.job for r in results] == ["other"]
    assert capsys.readouterr().err == (
        f"pushgw spark: {NAME} failed: its run returned the JobResult of 'weekly_digest', "
        f"not of '{NAME}': no result-{NAME}.json was written\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["result-other.json"]
