"""Running one job from a command line: `pushgw spark run` and the spark-submit scripts.

Exit statuses: 0 done; 1 the job failed; 2 usage or environment error (unknown job or
option, missing receipts directory, pyspark or Java 17 missing).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from spark_plugins.jobs import JobResult, OptionError, SparkJob, collect_jobs
from spark_plugins.session import get_session, spark_problem, under_spark_submit


def discover_jobs(extra: dict[str, object] | None = None) -> dict[str, SparkJob]:
    """Every `SparkJob` from every installed plugin (the `pushgw_spark_jobs` hook).

    Plugins that fail to load are skipped with a warning, so one broken third-party
    package does not hide the other jobs.
    """
    from gateway.plugins import PluginRegistry, installed_plugins

    names = []
    for info in installed_plugins():
        if info.error is None:
            names.append(info.name)
        else:
            print(f"pushgw spark: skipping plugin {info.name}: {info.error}", file=sys.stderr)
    registry = PluginRegistry(names, extra=extra)
    return collect_jobs(registry.broadcast("pushgw_spark_jobs"))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--receipts", required=True, help="receipts directory (path or URI)")
    parser.add_argument("--out", required=True, help="output directory (path or URI)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="job option (repeatable); `pushgw spark list` shows each job's options",
    )


def parse_conf(items: Sequence[str]) -> dict[str, str]:
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise OptionError(f"--conf {item!r}: expected KEY=VALUE")
        conf[key.strip()] = value
    return conf


def run_job(
    job: SparkJob,
    receipts: str,
    out: str,
    option_items: Sequence[str] = (),
    *,
    master: str | None = None,
    conf: dict[str, str] | None = None,
    stop: bool = True,
) -> tuple[int, JobResult | None]:
    """Resolve options, start Spark, run `job`, print a summary. Returns (status, result)."""
    try:
        options = job.resolve_options(option_items)
    except OptionError as exc:
        print(f"pushgw spark: {exc}", file=sys.stderr)
        return 2, None
    problem = None if under_spark_submit() else spark_problem()
    if problem:
        print(f"pushgw spark: cannot run {job.name}: {problem}", file=sys.stderr)
        return 2, None
    spark = get_session(master, app_name=f"pushgw {job.name}", conf=conf)
    try:
        result = job.run(spark, receipts, out, options)
    except (FileNotFoundError, OptionError) as exc:
        print(f"pushgw spark: {job.name}: {exc}", file=sys.stderr)
        return 2, None
    except Exception as exc:
        print(f"pushgw spark: {job.name} failed: {exc}", file=sys.stderr)
        return 1, None
    finally:
        if stop:
            spark.stop()
    print_result(result)
    return 0, result


def print_result(result: JobResult, stream: Any = None) -> None:
    stream = stream or sys.stdout
    stats = result.input
    print(
        f"{result.job}: {stats.records} receipts from {stats.files} files, "
        f"{stats.bad} bad lines skipped, {result.seconds:.1f}s",
        file=stream,
    )
    for name, path in result.outputs.items():
        print(f"  {name}: {path}", file=stream)
    print("  " + json.dumps(result.metrics, default=str), file=stream)


def submit_main(job_name: str | None = None, argv: Sequence[str] | None = None) -> int:
    """The body of the spark-submit entry scripts (`spark_plugins/submit/*.py`).

    With `job_name` the built-in job of that name runs; without, the first positional
    argument names any job from any installed plugin.
    """
    parser = argparse.ArgumentParser(
        prog=job_name or "run_job", description="Run a pushgw Spark job (spark-submit entry)."
    )
    if job_name is None:
        parser.add_argument("job", help="job name (`pushgw spark list`)")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    name = job_name or args.job
    if job_name is not None:
        from spark_plugins.builtin import BUILTIN_JOBS

        jobs = {job.name: job for job in BUILTIN_JOBS}
    else:
        jobs = discover_jobs()
    job = jobs.get(name)
    if job is None:
        print(f"unknown Spark job {name!r} (known: {', '.join(sorted(jobs))})", file=sys.stderr)
        return 2
    status, _ = run_job(job, args.receipts, args.out, args.option)
    return status
