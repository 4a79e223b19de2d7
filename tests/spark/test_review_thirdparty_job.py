"""A Spark job from a third-party distribution, written from docs/spark.md only.

`tests/spark/thirdparty_job/` is that distribution (`pushgw-latency`, entry point
`latency`); it is installed as tests/conftest.py installs the sample plugin: a
dist-info with its entry point on sys.path. What a built-in job gets from pushgw, it
must get too (DESIGN.md, rule 2): listing, options checked before Spark, a
`result-<job>.json`, its run time, the skipped lines on stderr, one-line errors.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

import pytest

from spark_plugins import JobResult, SparkJob, plugin, runner, synthetic
from tests.conftest import install_plugin_dist

JOB_DIST = Path(__file__).parent / "thirdparty_job"


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The `pushgw-latency` distribution installed; more plugins can be put in `site`."""
    site = tmp_path / "site"
    install_plugin_dist(site, "latency")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(JOB_DIST))
    return site


def _plugin(site: Path, name: str, body: str) -> None:
    """Another installed plugin `pushgw_NAME` whose module is `body`."""
    install_plugin_dist(site, name)
    (site / f"pushgw_{name}.py").write_text("from gateway.api import hookimpl\n" + body)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pushgw")
    plugin.pushgw_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.handler(args, None))


def test_the_installed_job_is_listed_with_its_options(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(["spark", "list"]) == 0
    out = capsys.readouterr().out
    assert "latency-by-reason\n    per reason: count and p95 latency, CSV\n" in out
    assert "--option quantile=0.95  (float: > 0, <= 1) latency quantile" in out
    assert "delivery-report\n" in out


BROKEN_HOOKS = {
    "raises": "@hookimpl\ndef pushgw_spark_jobs():\n    raise RuntimeError('no jobs today')\n",
    "one_job": (
        "from spark_plugins import SparkJob\n"
        "@hookimpl\ndef pushgw_spark_jobs():\n"
        "    return SparkJob('lonely', 'a job not in a list', print)\n"
    ),
    "not_a_job": "@hookimpl\ndef pushgw_spark_jobs():\n    return ['per-app']\n",
}


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("raises", "its pushgw_spark_jobs hook raised RuntimeError: no jobs today"),
        ("one_job", "its pushgw_spark_jobs hook returned a SparkJob, not a list of them"),
        ("not_a_job", "its pushgw_spark_jobs hook returned 'per-app', not a SparkJob"),
    ],
)
def test_a_broken_jobs_hook_hides_no_other_plugins_jobs(
    site: Path, capsys: pytest.CaptureFixture[str], hook: str, message: str
) -> None:
    """One plugin's bad `pushgw_spark_jobs` hook is skipped, named, in one line: the
    built-in jobs and the other third-party ones are still listed and run."""
    _plugin(site, hook, BROKEN_HOOKS[hook])  # a module name of its own: imported once
    assert _cli(["spark", "list"]) == 0
    captured = capsys.readouterr()
    assert "latency-by-reason\n" in captured.out and "delivery-report\n" in captured.out
    assert captured.err == f"pushgw spark: skipping plugin {hook}: {message}\n"


def test_a_job_name_defined_twice_names_both_plugins(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plugin(
        site,
        "copycat",
        "from spark_plugins import SparkJob\n"
        "@hookimpl\ndef pushgw_spark_jobs():\n"
        "    return [SparkJob('latency-by-reason', 'the same name', print)]\n",
    )
    assert _cli(["spark", "list"]) == 2
    assert capsys.readouterr().err == (
        "pushgw spark: cannot collect Spark jobs: plugins 'copycat' and 'latency' "
        "both define the Spark job 'latency-by-reason'\n"
    )


class _Spark:
    """Stands in for a SparkSession that no job touches."""

    def stop(self) -> None:
        pass


def _job(name: str, outcome: Any) -> SparkJob:
    def run(spark: Any, receipts: str, out: str, options: Any) -> Any:
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return SparkJob(name, name, run)


@pytest.mark.parametrize(
    ("outcome", "message"),
    [
        (None, "its run returned None, not a JobResult"),
        ({"job": "first"}, "its run returned a dict, not a JobResult"),
        (KeyError("top"), "KeyError: 'top'"),
        (AttributeError("'NoneType' object has no attribute 'df'"), "AttributeError: 'NoneType'"),
    ],
)
def test_a_job_that_breaks_its_contract_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    outcome: Any,
    message: str,
) -> None:
    """No traceback: the job fails (status 1) with a line saying what went wrong, and
    the next job still runs."""
    monkeypatch.setattr(runner, "spark_problem", lambda: None)
    monkeypatch.setattr(runner, "get_session", lambda master, **kw: _Spark())
    (tmp_path / "r").mkdir()
    jobs = [_job("first", outcome), _job("second", JobResult("second"))]
    status, results = runner.run_jobs(jobs, str(tmp_path / "r"), str(tmp_path / "o"))
    assert status == 1
    assert [r.job for r in results] == ["second"]
    err = capsys.readouterr().err
    assert err.startswith(f"pushgw spark: first failed: {message}")
    assert len(err.splitlines()) == 1


def test_a_bug_in_a_jobs_option_check_is_the_jobs_not_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A `check` that raises something other than ValueError is the job's bug: one line
    naming the job and the error's kind, status 1, before Spark starts. Before, the
    exception left `pushgw spark run` and was blamed on pushgw's own plugin."""

    def check(options: dict[str, Any]) -> None:
        raise KeyError(options.get("missing", "top"))

    monkeypatch.setattr(runner, "spark_problem", lambda: pytest.fail("Spark was looked for"))
    (tmp_path / "r").mkdir()
    job = SparkJob("checked", "checked", _job("checked", JobResult("checked")).run, check=check)
    status, results = runner.run_jobs([job], str(tmp_path / "r"), str(tmp_path / "o"))
    assert (status, results) == (1, [])
    assert capsys.readouterr().err == (
        "pushgw spark: job checked: its option check raised KeyError: 'top'\n"
    )


@pytest.mark.spark
def test_the_job_gets_what_a_built_in_gets(
    site: Path, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run through `pushgw spark run`'s own path (discovered by entry point, options
    parsed, paths checked), in the shared session: the job's CSV, and, as every
    built-in job, `result-<job>.json`, its run time and its skipped lines on stderr."""
    receipts = tmp_path / "receipts"
    items = list(synthetic.receipts(400, seed=7, tokens=20))
    synthetic.write_with_receipt_writer(items, receipts)
    (receipts / "receipts-hand.jsonl").write_text('{"v": 1}\n')
    out = tmp_path / "out"
    job = runner.discover_jobs()["latency-by-reason"]
    status, results = runner.run_jobs(
        [job], str(receipts), str(out), ["top=3", "sent_only=no"], master="local[2]", stop=False
    )
    assert status == 0
    (result,) = results
    # the job's own output, against a plain count
    (part,) = (out / "latency-by-reason").glob("part-*.csv")
    rows = list(csv.DictReader(part.open()))
    by_reason: dict[str, int] = {}
    for item in items:
        by_reason[item.reason or ""] = by_reason.get(item.reason or "", 0) + 1
    top = sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    assert [(r["reason"], int(r["count"])) for r in rows] == top
    # what the runner adds for every job
    assert result.seconds > 0
    written = json.loads((out / "result-latency-by-reason.json").read_text())
    assert written["job"] == "latency-by-reason"
    assert written["seconds"] == round(result.seconds, 3)
    assert written["input"]["records"] == 400 and written["input"]["bad"] == 1
    assert result.outputs["result-latency-by-reason.json"] == str(
        out / "result-latency-by-reason.json"
    )
    captured = capsys.readouterr()
    assert "receipts-hand.jsonl:1: '{\"v\": 1}'" in captured.err
    assert "latency-by-reason: 400 receipts from 2 files, 1 bad lines skipped" in captured.out
