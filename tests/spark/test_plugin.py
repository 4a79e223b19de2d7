"""The plugin side of the Spark jobs: discovery, `pushgw spark` commands, options, imports.

None of these start Spark (they run without pyspark or Java).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.api import hookimpl
from spark_plugins import JobOption, JobResult, OptionError, SparkJob, plugin, runner
from spark_plugins.jobs import collect_jobs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--receipts r --out o` name a receipts directory and a creatable output here
    (local paths are checked before Spark starts)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r").mkdir()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pushgw")
    plugin.pushgw_commands(parser.add_subparsers(dest="command"))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.handler(args, None))


class ThirdParty:
    """A plugin from another package contributing its own job."""

    ran: list[tuple[str, str, dict[str, Any]]] = []

    @staticmethod
    def _run(spark: Any, receipts: str, out: str, options: Any) -> JobResult:
        ThirdParty.ran.append((receipts, out, dict(options)))
        return JobResult("per-country")

    @hookimpl
    def pushgw_spark_jobs(self) -> list[SparkJob]:
        return [
            SparkJob(
                "per-country",
                "pushes per country",
                self._run,
                (JobOption("top", int, 10, "how many"),),
            )
        ]


def test_builtin_jobs_come_from_the_hook() -> None:
    names = [job.name for job in plugin.pushgw_spark_jobs()]
    assert names == ["delivery-report", "dead-tokens", "volume-anomalies"]


def test_jobs_of_every_plugin_are_discovered() -> None:
    jobs = runner.discover_jobs(extra={"geo": ThirdParty()})
    assert {"delivery-report", "dead-tokens", "volume-anomalies", "per-country"} <= set(jobs)


def test_duplicate_job_names_are_refused() -> None:
    job = plugin.pushgw_spark_jobs()
    with pytest.raises(ValueError, match="two plugins define"):
        collect_jobs([job, job])


def test_spark_list_shows_jobs_and_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        runner,
        "discover_jobs",
        lambda: collect_jobs([plugin.pushgw_spark_jobs(), ThirdParty().pushgw_spark_jobs()]),
    )
    assert _run(["spark", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("delivery-report", "dead-tokens", "volume-anomalies", "per-country"):
        assert f"{name}\n" in out
    assert "--option transient_failures=5" in out
    assert "--option top=10" in out


def test_spark_run_third_party_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        runner, "discover_jobs", lambda: collect_jobs([ThirdParty().pushgw_spark_jobs()])
    )
    monkeypatch.setattr(runner, "spark_problem", lambda: None)

    class FakeSpark:
        stopped = False

        def stop(self) -> None:
            FakeSpark.stopped = True

    seen: dict[str, Any] = {}

    def fake_session(master: str | None, **kwargs: Any) -> FakeSpark:
        seen["master"] = master
        seen["conf"] = kwargs.get("conf")
        return FakeSpark()

    monkeypatch.setattr(runner, "get_session", fake_session)
    argv = [
        "spark",
        "run",
        "per-country",
        "--receipts",
        "r",
        "--out",
        "o",
        "--option",
        "top=3",
        "--master",
        "spark://h:7077",
        "--conf",
        "spark.executor.memory=4g",
    ]
    assert _run(argv) == 0
    assert ThirdParty.ran[-1] == ("r", "o", {"top": 3})
    assert seen == {"master": "spark://h:7077", "conf": {"spark.executor.memory": "4g"}}
    assert FakeSpark.stopped
    assert "per-country: 0 receipts" in capsys.readouterr().out


class CountingSpark:
    """Stands in for a SparkSession where no job touches it."""

    sessions = 0
    stopped = 0

    def __init__(self) -> None:
        CountingSpark.sessions += 1

    def stop(self) -> None:
        CountingSpark.stopped += 1


def _two_jobs(
    ran: list[tuple[str, dict[str, Any]]],
    fail: str | None = None,
    error: Exception | None = None,
) -> list[SparkJob]:
    def job(name: str, *options: JobOption) -> SparkJob:
        def run(spark: Any, receipts: str, out: str, resolved: Any) -> JobResult:
            ran.append((name, dict(resolved)))
            if name == fail:
                raise error or RuntimeError("boom")
            return JobResult(name)

        return SparkJob(name, name, run, options)

    shared = JobOption("max_bad_lines", int, 100, "shared")
    return [
        job("first", shared, JobOption("chart", bool, True, "only first")),
        job("second", shared, JobOption("window", int, 7, "only second")),
    ]


def test_several_jobs_share_one_session_in_order(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(runner, "discover_jobs", lambda: collect_jobs([_two_jobs(ran)]))
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", lambda master, **kw: CountingSpark())
    CountingSpark.sessions = CountingSpark.stopped = 0
    options = ["max_bad_lines=5", "second:window=3", "chart=no"]
    argv = ["spark", "run", "second", "first", "--receipts", "r", "--out", "o"]
    assert _run([*argv, *[x for o in options for x in ("--option", o)]]) == 0
    assert (CountingSpark.sessions, CountingSpark.stopped) == (1, 1)
    assert ran == [
        ("second", {"max_bad_lines": 5, "window": 3}),
        ("first", {"max_bad_lines": 5, "chart": False}),
    ]
    out = capsys.readouterr().out
    assert out.index("second: 0 receipts") < out.index("first: 0 receipts")


def test_a_failing_job_does_not_stop_the_next(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", lambda master, **kw: CountingSpark())
    CountingSpark.sessions = CountingSpark.stopped = 0
    status, results = runner.run_jobs(_two_jobs(ran, fail="first"), "r", "o")
    assert status == 1
    assert [name for name, _ in ran] == ["first", "second"]
    assert [r.job for r in results] == ["second"]
    assert CountingSpark.stopped == 1
    assert "first failed: boom" in capsys.readouterr().err


def test_a_failing_jobs_java_trace_is_left_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What Py4J raises for an error in the JVM: the message, then the Java frames."""
    error = RuntimeError(
        "An error occurred while calling o797.geq.\n"
        ': java.lang.NumberFormatException: For input string: "1e20"\n'
        "\tat java.base/java.lang.Long.parseLong(Long.java:711)\n"
        "\tat org.apache.spark.sql.Column.geq(Column.scala:400)\n"
        "\t... 12 more\n"
    )
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", lambda master, **kw: CountingSpark())
    status, _ = runner.run_jobs(_two_jobs([], fail="first", error=error), "r", "o")
    assert status == 1
    assert capsys.readouterr().err == (
        "pushgw spark: first failed: An error occurred while calling o797.geq. "
        'java.lang.NumberFormatException: For input string: "1e20"\n'
    )


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["nope=1"], "unknown option 'nope' (known: chart, max_bad_lines, window)"),
        (["third:window=1"], "job 'third' is not being run"),
        (["first:window=1"], "job first: unknown option 'window'"),
        (["window"], "expected NAME=VALUE or JOB:NAME=VALUE"),
        (["window=soon"], "option window"),
    ],
)
def test_options_of_several_jobs_are_checked_before_spark_starts(
    monkeypatch: pytest.MonkeyPatch, items: list[str], message: str
) -> None:
    def no_session(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Spark must not start on a usage error")

    monkeypatch.setattr(runner, "get_session", no_session)
    with pytest.raises(OptionError, match=re.escape(message)):
        runner.resolve_job_options(_two_jobs([]), items)
    status, results = runner.run_jobs(_two_jobs([]), "r", "o", items)
    assert (status, results) == (2, [])


def test_a_job_named_twice_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    base = ["--receipts", "r", "--out", "o"]
    assert _run(["spark", "run", "dead-tokens", "dead-tokens", *base]) == 2
    assert "a job is named twice" in capsys.readouterr().err
    assert _run(["spark", "run", "dead-tokens", "no-such-job", *base]) == 2
    assert "unknown job 'no-such-job'" in capsys.readouterr().err


def test_spark_run_usage_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    base = ["--receipts", "r", "--out", "o"]
    assert _run(["spark", "run", "no-such-job", *base]) == 2
    assert "unknown job 'no-such-job'" in capsys.readouterr().err
    assert _run(["spark", "run", "dead-tokens", *base, "--option", "nope=1"]) == 2
    assert "unknown option 'nope'" in capsys.readouterr().err
    assert _run(["spark", "run", "dead-tokens", *base, "--option", "transient_failures=x"]) == 2
    assert "transient_failures" in capsys.readouterr().err


def test_spark_run_without_spark_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from spark_plugins import session

    monkeypatch.setattr(runner, "spark_problem", lambda: session.PYSPARK_HELP)
    assert _run(["spark", "run", "delivery-report", "--receipts", "r", "--out", "o"]) == 2
    assert "pip install 'pushgw[spark]'" in capsys.readouterr().err
    monkeypatch.setenv("JAVA_HOME", "/nonexistent")
    monkeypatch.setenv("PATH", "/nonexistent")
    problem = session.java_problem()
    assert problem is not None and "Java 17" in problem and "JAVA_HOME" in problem


def test_options_are_typed() -> None:
    from spark_plugins.dead_tokens import JOB

    options = JOB.resolve_options(
        ["transient_failures=7", "permanent_statuses=token_invalid, permanent", "now=1.5e9"]
    )
    assert options["transient_failures"] == 7
    assert options["permanent_statuses"] == ("token_invalid", "permanent")
    assert options["now"] == 1.5e9
    assert options["window_hours"] == 168.0
    with pytest.raises(OptionError):
        JOB.resolve_options(["window_hours"])
    from spark_plugins.delivery_report import JOB as REPORT

    assert REPORT.resolve_options(["chart=no"])["chart"] is False


def test_importing_the_plugin_does_not_import_pyspark() -> None:
    code = (
        "import sys, spark_plugins.plugin, spark_plugins.runner, spark_plugins.builtin\n"
        "assert 'pyspark' not in sys.modules, 'pyspark imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize(
    "script", ["delivery_report", "dead_tokens", "volume_anomalies", "run_job"]
)
def test_submit_scripts_are_plain_scripts(script: str) -> None:
    from spark_plugins.submit import DIR

    path = Path(DIR) / f"{script}.py"
    proc = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    assert "--receipts" in proc.stdout and "--out" in proc.stdout
