"""Usage errors of `pushgw spark run`: one line, exit status 2, before Spark starts and
before any job runs or anything is written (docs/spark.md, "Exit status").

None of these start Spark: a session request fails the test.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_plugins import JobOption, JobResult, OptionError, SparkJob, plugin, runner
from spark_plugins.builtin import BUILTIN_JOBS
from spark_plugins.dead_tokens import JOB as DEAD_TOKENS
from spark_plugins.delivery_report import JOB as REPORT
from spark_plugins.jobs import collect_jobs
from spark_plugins.volume_anomalies import JOB as ANOMALIES

ALL = ["dead-tokens", "volume-anomalies", "delivery-report"]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pushgw")
    plugin.pushgw_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.handler(args, None))


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Built-in jobs whose runs are recorded; starting Spark fails the test."""
    ran: list[str] = []

    def recorded(job: SparkJob) -> SparkJob:
        def run(spark: Any, receipts: str, out: str, options: Any) -> JobResult:
            ran.append(job.name)
            return JobResult(job.name)

        return dataclasses.replace(job, run=run)

    def no_session(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Spark must not start on a usage error")

    jobs = [recorded(job) for job in BUILTIN_JOBS]
    monkeypatch.setattr(runner, "discover_jobs", lambda: collect_jobs([jobs]))
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", no_session)
    yield ran


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], ran: list[str]) -> str:
    """Run the command, expect status 2, no job run; return its single stderr line."""
    assert _run(["spark", "run", *argv]) == 2
    assert ran == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a receipts directory and a regular file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "receipts").mkdir()
    (tmp_path / "afile").write_text("x\n")
    return tmp_path


# --- paths -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("receipts", "out", "message"),
    [
        ("nope", "out", "receipts directory not found: nope"),
        ("afile", "out", "receipts path is not a directory: afile"),
        ("file:afile", "out", "receipts path is not a directory: file:afile"),
        ("receipts", "afile", "output path exists and is not a directory: afile"),
        ("receipts", "afile/out", "cannot be created: "),
        ("receipts", "afile/a/b", "is not a directory (afile/a/b)"),
        ("receipts", "receipts", "is inside the receipts directory"),
        ("receipts", "receipts/reports", "is inside the receipts directory"),
        ("receipts/", "./receipts/x/../reports", "is inside the receipts directory"),
    ],
)
def test_bad_paths_are_usage_errors_before_spark(
    work: Path,
    no_spark: list[str],
    capsys: pytest.CaptureFixture[str],
    receipts: str,
    out: str,
    message: str,
) -> None:
    before = sorted(p.name for p in work.rglob("*"))
    line = _usage_error(capsys, [*ALL, "--receipts", receipts, "--out", out], no_spark)
    assert line.startswith("pushgw spark: ") and message in line
    assert sorted(p.name for p in work.rglob("*")) == before  # nothing written


def test_out_may_be_missing_several_levels_deep(work: Path) -> None:
    assert runner.path_problem("receipts", "a/b/c") is None
    assert runner.path_problem("receipts", str(work / "receipts-out")) is None  # a sibling
    assert not (work / "a").exists()  # the check creates nothing


def test_out_through_a_symlink_into_the_receipts_is_refused(work: Path) -> None:
    (work / "link").symlink_to(work / "receipts")
    problem = runner.path_problem("receipts", "link/reports")
    assert problem is not None and "inside the receipts directory" in problem
    (work / "dangling").symlink_to(work / "gone")
    problem = runner.path_problem("receipts", "dangling")
    assert problem is not None and "broken symbolic link" in problem


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_out_parent_is_a_usage_error(work: Path) -> None:
    locked = work / "locked"
    locked.mkdir(mode=0o500)
    try:
        problem = runner.path_problem("receipts", "locked/out")
        assert problem is not None and "not writable" in problem
    finally:
        locked.chmod(0o700)


def test_uris_are_left_to_the_jobs() -> None:
    assert runner.path_problem("hdfs:///pushgw/receipts", "s3a://bucket/reports") is None
    assert runner.path_problem("s3a://bucket/receipts", "s3a://bucket/receipts/out") is None


def test_read_receipts_says_a_file_is_not_a_directory(work: Path) -> None:
    pytest.importorskip("pyspark")
    from spark_plugins.reader import read_receipts

    # the path is checked before the session is used: no Spark needed
    with pytest.raises(FileNotFoundError, match="receipts path is not a directory: afile"):
        read_receipts(None, "afile")  # type: ignore[arg-type]


def test_valid_paths_reach_the_jobs(
    work: Path, no_spark: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Session:
        def stop(self) -> None:
            pass

    monkeypatch.setattr(runner, "get_session", lambda master, **kw: Session())
    argv = [*ALL, "--receipts", "receipts", "--out", "reports/today"]
    assert _run(["spark", "run", *argv]) == 0
    assert no_spark == ALL


# --- option values ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("by=foo", "job volume-anomalies: option by: 'foo' is not one of plugin, provider, app_id"),
        ("by=plugin,plugin", "option by: column 'plugin' named twice"),
        ("percentiles=bogus", "job delivery-report: option percentiles: 'bogus' is not one of"),
        ("permanent_statuses=token_invalid,ok", "option permanent_statuses: 'ok' is not one of"),
        ("transient_statuses=transiant", "option transient_statuses: 'transiant' is not one of"),
        ("hash_groups=-1", "option hash_groups: must be >= 1, not -1"),
        ("window_hours=-5", "option window_hours: must be > 0, not -5"),
        ("window_hours=nan", "option window_hours: not a number: 'nan'"),
        ("transient_failures=0", "option transient_failures: must be >= 1, not 0"),
        ("max_bad_lines=-3", "option max_bad_lines: must be >= 0, not -3"),
        ("sketch_k=4", "option sketch_k: must be >= 8, not 4"),
        ("factor=0.5", "option factor: must be >= 1, not 0.5"),
        ("min_failure_rate=2", "option min_failure_rate: must be <= 1, not 2"),
        ("transient_failures=many", "option transient_failures: not an integer: 'many'"),
        ("min_span_hours=200", "min_span_hours (200) is longer than window_hours (168)"),
        ("min_baseline_hours=30", "min_baseline_hours (30) is more than baseline_hours (24)"),
    ],
)
def test_option_values_are_checked_before_any_job_runs(
    work: Path,
    no_spark: list[str],
    capsys: pytest.CaptureFixture[str],
    option: str,
    message: str,
) -> None:
    """The reviewer's run: dead-tokens first, the bad value for a later job."""
    argv = [*ALL, "--receipts", "receipts", "--out", "out", "--option", option]
    line = _usage_error(capsys, argv, no_spark)
    assert line.startswith("pushgw spark: job ") and message in line
    assert not (work / "out").exists()


def test_spark_submit_scripts_check_before_running(
    work: Path, no_spark: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--receipts", "receipts", "--out", "out", "--option", "by=foo"]
    assert runner.submit_main("volume-anomalies", argv) == 2
    assert "option by: 'foo'" in capsys.readouterr().err
    assert runner.submit_main("dead-tokens", ["--receipts", "afile", "--out", "out"]) == 2
    assert "not a directory: afile" in capsys.readouterr().err


# Every numeric option of the built-in jobs: (job, option, lowest accepted, next rejected)
# and (job, option, highest accepted, next rejected) where there is a maximum.
LOWEST = [
    (REPORT, "sketch_k", "8", "7"),
    (REPORT, "accuracy", "1", "0"),
    (REPORT, "hash_groups", "1", "0"),
    (REPORT, "max_bad_lines", "0", "-1"),
    (DEAD_TOKENS, "transient_failures", "1", "0"),
    (DEAD_TOKENS, "window_hours", "0.001", "0"),
    (DEAD_TOKENS, "min_span_hours", "0", "-0.5"),
    (DEAD_TOKENS, "now", "0", "-1"),
    (DEAD_TOKENS, "max_bad_lines", "0", "-1"),
    (DEAD_TOKENS, "hash_groups", "1", "0"),
    (ANOMALIES, "factor", "1", "0.99"),
    (ANOMALIES, "baseline_hours", "1", "0"),
    (ANOMALIES, "min_baseline_hours", "1", "0"),
    (ANOMALIES, "min_volume", "0", "-1"),
    (ANOMALIES, "min_failures", "0", "-1"),
    (ANOMALIES, "min_failure_rate", "0", "-0.01"),
    (ANOMALIES, "now", "0", "-1"),
    (ANOMALIES, "max_bad_lines", "0", "-1"),
]
HIGHEST = [
    (REPORT, "sketch_k", "65535", "65536"),
    (REPORT, "accuracy", "2147483647", "2147483648"),
    (REPORT, "hash_groups", "2147483647", "2147483648"),
    (REPORT, "max_bad_lines", "2147483647", "2147483648"),
    (DEAD_TOKENS, "hash_groups", "2147483647", "2147483648"),
    (DEAD_TOKENS, "transient_failures", "2147483647", "2147483648"),
    (ANOMALIES, "baseline_hours", "2147483647", "2147483648"),
    (ANOMALIES, "min_baseline_hours", "2147483647", "2147483648"),
    # no bound of their own: an int option holds a Java long at most
    (ANOMALIES, "min_volume", "9223372036854775807", "9223372036854775808"),
    (ANOMALIES, "min_failures", "9223372036854775807", "9223372036854775808"),
    (ANOMALIES, "min_failure_rate", "1", "1.01"),
]


@pytest.mark.parametrize(("job", "name", "ok", "bad"), LOWEST + HIGHEST)
def test_numeric_option_bounds(job: SparkJob, name: str, ok: str, bad: str) -> None:
    given = [f"{name}={ok}"]
    if name == "baseline_hours":
        given.append("min_baseline_hours=1")
    if name == "min_baseline_hours":
        given.append(f"baseline_hours={ok}")
    if name == "window_hours":
        given.append("min_span_hours=0")
    expected = int(ok) if "." not in ok else float(ok)
    assert job.resolve_options(given)[name] == expected
    with pytest.raises(OptionError, match=re.escape(f"job {job.name}: option {name}: must be")):
        job.resolve_options([f"{name}={bad}"])


def test_every_builtin_numeric_option_has_a_lower_bound() -> None:
    numeric = {
        (job.name, opt.name)
        for job in BUILTIN_JOBS
        for opt in job.options
        if opt.type in (int, float)
    }
    assert {(job.name, name) for job, name, _, _ in LOWEST} == numeric
    for job in BUILTIN_JOBS:
        for opt in job.options:
            if opt.type in (int, float):
                assert opt.minimum is not None or opt.exclusive_minimum is not None, opt.name
        job.resolve_options({})  # the defaults are accepted


def test_an_int_option_of_any_job_holds_a_java_long_at_most() -> None:
    option = JobOption("n", int, 1, "a third party's option without bounds")
    assert option.parse(str(2**63 - 1)) == 2**63 - 1
    assert option.parse(str(-(2**63))) == -(2**63)
    with pytest.raises(OptionError, match=r"option n: must be <= 9223372036854775807, not 9"):
        option.parse(str(2**63))
    with pytest.raises(OptionError, match=r"option n: must be >= -9223372036854775808, not -9"):
        option.parse(str(-(2**63) - 1))


def test_values_given_as_python_objects_are_checked_too() -> None:
    with pytest.raises(OptionError, match="option sketch_k: must be >= 8"):
        REPORT.resolve_options({"sketch_k": 5})
    with pytest.raises(OptionError, match="option window_hours: not a number"):
        DEAD_TOKENS.resolve_options({"window_hours": math.nan})
    with pytest.raises(OptionError, match="option by: 'hour' is not one of"):
        ANOMALIES.resolve_options({"by": ["plugin", "hour"]})
    assert ANOMALIES.resolve_options({"by": ["app_id", "plugin"]})["by"] == ("app_id", "plugin")
    assert ANOMALIES.resolve_options(["by="])["by"] == ()  # the whole gateway
    assert DEAD_TOKENS.resolve_options({"now": None})["now"] is None  # "not set"
    with pytest.raises(OptionError, match="option factor: a value is required"):
        ANOMALIES.resolve_options({"factor": None})


def test_spark_list_shows_what_options_accept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "discover_jobs", lambda: collect_jobs([BUILTIN_JOBS]))
    assert _run(["spark", "list"]) == 0
    out = capsys.readouterr().out
    assert "--option percentiles=sketch  (str: sketch|exact|approx)" in out
    assert "--option by=plugin  (tuple: plugin|provider|app_id)" in out
    assert "--option window_hours=168.0  (float: > 0)" in out
    assert "--option sketch_k=1000  (int: >= 8, <= 65535)" in out


# --- the plugin API ----------------------------------------------------------------------


def test_third_party_options_declared_the_old_way_still_work() -> None:
    """Positional JobOption / SparkJob as before: any value of the type is accepted."""

    def run(spark: Any, receipts: str, out: str, options: Any) -> JobResult:
        return JobResult("old")

    old = SparkJob("old", "old style", run, (JobOption("top", int, 10, "rows"),), "old.py")
    assert old.resolve_options(["top=-5"]) == {"top": -5}
    assert old.check is None and old.options[0].accepts() == ""
    with pytest.raises(TypeError):  # the new fields are keyword-only
        JobOption("top", int, 10, "rows", (1, 2))  # type: ignore[misc]


def test_third_party_choices_check_and_job_check() -> None:
    def even(value: int) -> None:
        if value % 2:
            raise ValueError(f"must be even, not {value}")

    def low_below_high(options: Any) -> None:
        if options["low"] >= options["high"]:
            raise ValueError("low must be below high")

    def run(spark: Any, receipts: str, out: str, options: Any) -> JobResult:
        return JobResult("geo")

    job = SparkJob(
        "geo",
        "pushes per country",
        run,
        (
            JobOption("level", str, "country", "grain", choices=("country", "city")),
            JobOption("low", int, 2, "low", minimum=0, check=even),
            JobOption("high", int, 10, "high", maximum=100),
        ),
        check=low_below_high,
    )
    assert job.resolve_options(["level=city", "low=4"]) == {"level": "city", "low": 4, "high": 10}
    cases = {
        "level=town": "job geo: option level: 'town' is not one of country, city",
        "low=3": "job geo: option low: must be even, not 3",
        "low=-2": "job geo: option low: must be >= 0, not -2",
        "high=101": "job geo: option high: must be <= 100, not 101",
        "high=2": "job geo: low must be below high",
    }
    for item, message in cases.items():
        with pytest.raises(OptionError, match=re.escape(message)):
            job.resolve_options([item])
