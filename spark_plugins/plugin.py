"""The `receipts-spark` plugin: the built-in Spark jobs and the `pushgw spark` command.

- `pushgw_spark_jobs()` returns the built-in jobs (`delivery-report`, `dead-tokens`,
  `volume-anomalies`); any plugin may return more from the same hook.
- `pushgw_commands()` adds `pushgw spark list` and
  `pushgw spark run JOB [JOB ...] --receipts DIR --out DIR [--master URL] [--option k=v ...]`
  (several jobs run one after another in one Spark session).

Importing this module never imports pyspark; `pushgw spark run` without pyspark or Java
17 says what to install and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any

from gateway.api import hookimpl
from spark_plugins.builtin import BUILTIN_JOBS
from spark_plugins.jobs import JobOption, OptionError, SparkJob


@hookimpl
def pushgw_spark_jobs() -> Iterable[SparkJob]:
    return BUILTIN_JOBS


@hookimpl
def pushgw_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from spark_plugins.runner import add_run_arguments

    spark = subparsers.add_parser(
        "spark",
        help="Spark jobs over delivery receipts",
        description="Batch jobs over delivery receipts, contributed by plugins.",
    )
    commands = spark.add_subparsers(dest="spark_command", metavar="{list,run}")
    commands.required = True
    listing = commands.add_parser("list", help="list the Spark jobs of all installed plugins")
    listing.set_defaults(handler=list_command)
    run = commands.add_parser(
        "run",
        help="run Spark jobs",
        description="Run Spark jobs, in order, in one Spark session: embedded local Spark "
        "unless --master names a cluster.",
    )
    run.add_argument("jobs", nargs="+", metavar="JOB", help="job name(s) (see `pushgw spark list`)")
    add_run_arguments(run)
    run.add_argument("--master", default=None, help="Spark master URL (default: local[*])")
    run.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Spark configuration, e.g. spark.driver.memory=12g (repeatable)",
    )
    run.set_defaults(handler=run_command)


def _jobs() -> dict[str, SparkJob] | None:
    from gateway.config import ConfigError
    from spark_plugins.runner import discover_jobs

    try:
        return discover_jobs()
    except (ConfigError, ValueError, TypeError) as exc:
        print(f"pushgw spark: cannot collect Spark jobs: {exc}", file=sys.stderr)
        return None


def list_command(args: argparse.Namespace, command_context: Any) -> int:
    jobs = _jobs()
    if jobs is None:
        return 2
    for job in sorted(jobs.values(), key=lambda j: j.name):
        print(f"{job.name}\n    {job.description}")
        for opt in job.options:
            default = ",".join(opt.default) if isinstance(opt.default, tuple) else opt.default
            accepts = opt.accepts() if isinstance(opt, JobOption) else ""
            kind = f"{opt.type.__name__}: {accepts}" if accepts else opt.type.__name__
            print(f"    --option {opt.name}={default}  ({kind}) {opt.help}")
    return 0


def run_command(args: argparse.Namespace, command_context: Any) -> int:
    from spark_plugins.runner import parse_conf, run_jobs, select_jobs

    known = _jobs()
    jobs = None if known is None else select_jobs(known, args.jobs)
    if jobs is None:
        return 2
    try:
        conf = parse_conf(args.conf)
    except OptionError as exc:
        print(f"pushgw spark: {exc}", file=sys.stderr)
        return 2
    status, _ = run_jobs(jobs, args.receipts, args.out, args.option, master=args.master, conf=conf)
    return status
