"""Running jobs from a command line: `pushgw spark run` and the spark-submit scripts.

Several jobs named in one run share one Spark session, one after another: the JVM
starts once and later jobs run on code it has already compiled (on the benchmark
machine, 2 cores, the three built-in jobs over 1M receipts took 61-63 s in one run
against 99-113 s as three runs). Each job writes into the same `--out`, exactly as
separate runs would.

Exit statuses: 0 done; 1 a job failed (the others still ran); 2 usage or environment
error: unknown job or option, an option value the option does not accept (its choices,
bounds, checks: `JobOption`), a local receipts directory that is missing or not a
directory, a local `--out` that cannot be a directory, pyspark or Java 17 missing. All of
these are found before Spark starts (under spark-submit: before any job runs) and before
anything is written; only what needs Spark to see (`hdfs://`, `s3a://`... paths) is left
to the jobs. 143 (SIGTERM) and Ctrl-C (130, from the command) stop the jobs and name the
one left incomplete. `result-<job>.json` is each job's completion marker: removed before
the job runs, written last (docs/spark.md, "Interrupted runs").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from spark_plugins.jobs import (
    JobContractError,
    JobResult,
    OptionError,
    SparkJob,
    collect_jobs,
    looks_like_job,
)
from spark_plugins.output import join, out_problem, remove_file, write_result
from spark_plugins.paths import arg_path, is_local, uri_path
from spark_plugins.reader import receipts_problem, report_bad_input
from spark_plugins.session import get_session, spark_problem, under_spark_submit


def discover_jobs(extra: dict[str, object] | None = None) -> dict[str, SparkJob]:
    """Every `SparkJob` from every installed plugin (the `pushgw_spark_jobs` hook).

    A plugin that fails to load, whose hook raises, or whose hook returns anything but
    an iterable of `SparkJob`s is skipped with a one-line warning naming it, so one
    broken third-party package does not hide the other jobs. A job name two plugins
    define is a `ValueError` naming both.
    """
    from gateway.plugins import PluginRegistry, installed_plugins

    names = []
    for info in installed_plugins():
        if info.error is None:
            names.append(info.name)
        else:
            print(f"pushgw spark: skipping plugin {info.name}: {info.error}", file=sys.stderr)
    registry = PluginRegistry(names, extra=extra)
    owners: list[str] = []
    results: list[list[SparkJob]] = []
    for name in registry.implementers("pushgw_spark_jobs"):
        try:
            returned = registry.call(name, "pushgw_spark_jobs")
        except Exception as exc:  # a plugin's bug: skipped, said in one line
            problem = f"its pushgw_spark_jobs hook raised {type(exc).__name__}: {exc}"
            print(f"pushgw spark: skipping plugin {name}: {problem}", file=sys.stderr)
            continue
        try:
            results.append(_hook_jobs(returned))
        except TypeError as exc:
            print(f"pushgw spark: skipping plugin {name}: {exc}", file=sys.stderr)
            continue
        owners.append(name)
    return collect_jobs(results, owners)


def _hook_jobs(returned: Any) -> list[SparkJob]:
    """What one plugin's `pushgw_spark_jobs` hook returned, checked: a list of jobs."""
    if returned is None:
        return []
    if isinstance(returned, SparkJob):
        raise TypeError("its pushgw_spark_jobs hook returned a SparkJob, not a list of them")
    try:
        found = list(returned)
    except TypeError:
        raise TypeError(
            f"its pushgw_spark_jobs hook returned {returned!r}, not a list of SparkJob"
        ) from None
    for job in found:
        if not looks_like_job(job):
            raise TypeError(f"its pushgw_spark_jobs hook returned {job!r}, not a SparkJob")
    return found


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--receipts", required=True, help="receipts directory (path or URI)")
    parser.add_argument("--out", required=True, help="output directory (path or URI)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="job option (repeatable): NAME=VALUE for every job that has it, "
        "JOB:NAME=VALUE for one; `pushgw spark list` shows each job's options",
    )


def parse_conf(items: Sequence[str]) -> dict[str, str]:
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise OptionError(f"--conf {item!r}: expected KEY=VALUE")
        conf[key.strip()] = value
    return conf


def resolve_job_options(
    jobs: Sequence[SparkJob], option_items: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Each job's options (job name -> resolved options) from `--option` items.

    `NAME=VALUE` goes to every job that declares NAME (an error when none does);
    `JOB:NAME=VALUE` goes to that job only (an error when it is not among `jobs`).
    A job named twice is an error too.
    """
    given: dict[str, dict[str, str]] = {job.name: {} for job in jobs}
    if len(given) != len(jobs):
        raise OptionError(f"a job is named twice: {' '.join(job.name for job in jobs)}")
    for item in option_items:
        key, sep, value = item.partition("=")
        if not sep:
            raise OptionError(f"option {item!r}: expected NAME=VALUE or JOB:NAME=VALUE")
        target, colon, name = key.strip().rpartition(":")
        if colon:
            if target not in given:
                raise OptionError(f"option {item!r}: job {target!r} is not being run")
            given[target][name] = value
            continue
        takers = [job.name for job in jobs if any(opt.name == name for opt in job.options)]
        if not takers:
            known = sorted({opt.name for job in jobs for opt in job.options})
            raise OptionError(f"unknown option {name!r} (known: {', '.join(known) or 'none'})")
        for job_name in takers:
            given[job_name][name] = value
    # each job parses the strings with its options' types and validates the values
    return {job.name: job.resolve_options(given[job.name]) for job in jobs}


def path_problem(receipts: str, out: str) -> str | None:
    """What is wrong with `--receipts` and `--out`, as far as can be seen without Spark.

    Local paths only (`hdfs://`, `s3a://`... are left to the jobs): the receipts must be
    a readable directory; the output a writable directory or creatable as one; and the
    output must not lie inside the receipts, where the next read would take the jobs'
    `*.jsonl` and `*.parquet` files for receipts.
    """
    problem = receipts_problem(receipts) or out_problem(out)
    if problem or not (is_local(receipts) and is_local(out)):
        return problem
    inside = os.path.realpath(uri_path(receipts))
    target = os.path.realpath(arg_path(out))
    if os.path.commonpath([inside, target]) == inside:
        return (
            f"output directory {out} is inside the receipts directory {receipts}: "
            "its files would be read as receipts"
        )
    return None


def run_jobs(
    jobs: Sequence[SparkJob],
    receipts: str,
    out: str,
    option_items: Sequence[str] = (),
    *,
    master: str | None = None,
    conf: dict[str, str] | None = None,
    stop: bool = True,
) -> tuple[int, list[JobResult]]:
    """Check options and paths, start Spark once, run `jobs` in order, print a summary of each.

    Returns (exit status, results of the jobs that finished). A usage error (status 2)
    is one line on stderr before Spark starts. A failing job is reported and the next one
    still runs; a receipts directory a job finds missing stops the run (status 2).
    """
    names = [job.name for job in jobs]
    try:
        options = resolve_job_options(jobs, option_items)
    except OptionError as exc:
        print(f"pushgw spark: {exc}", file=sys.stderr)
        return 2, []
    except JobContractError as exc:  # a job's own bug, not the user's mistake
        print(f"pushgw spark: {exc}", file=sys.stderr)
        return 1, []
    problem = path_problem(receipts, out)
    if problem:
        print(f"pushgw spark: {problem}", file=sys.stderr)
        return 2, []
    problem = None if under_spark_submit() else spark_problem()
    if problem:
        print(f"pushgw spark: cannot run {', '.join(names)}: {problem}", file=sys.stderr)
        return 2, []
    spark = get_session(master, app_name=f"pushgw {' '.join(names)}", conf=conf)
    status = 0
    results: list[JobResult] = []
    current: SparkJob | None = None
    terminated: list[bool] = []
    try:
        with _sigterm_as_interrupt(terminated):
            for current in jobs:
                job = current
                started = time.monotonic()
                try:
                    # The completion marker: removed before the job writes anything, written
                    # last (`finish`), so that no earlier run's marker vouches for outputs
                    # this run left half-written, or mixed with that run's.
                    remove_file(spark, join(out, result_file(job.name)))
                    result = job.run(spark, receipts, out, options[job.name])
                    if not isinstance(result, JobResult):
                        kind = "None" if result is None else f"a {type(result).__name__}"
                        raise JobContractError(f"its run returned {kind}, not a JobResult")
                    if result.job != job.name:  # its marker would be another job's file
                        raise JobContractError(
                            f"its run returned the JobResult of {result.job!r}, "
                            f"not of {job.name!r}: no {result_file(job.name)} was written"
                        )
                    finish(spark, out, result, started)
                except (FileNotFoundError, OptionError) as exc:
                    print(f"pushgw spark: {job.name}: {exc}", file=sys.stderr)
                    return 2, results
                except Exception as exc:
                    text = failure_text(exc)
                    print(f"pushgw spark: {job.name} failed: {text}", file=sys.stderr)
                    status = 1
                    continue
                print_result(result)
                results.append(result)
            current = None
    except KeyboardInterrupt:
        print(interrupted_text(jobs, current, out, bool(terminated)), file=sys.stderr)
        if terminated:
            return EXIT_TERMINATED, results
        raise
    finally:
        if stop:
            spark.stop()
    return status, results


EXIT_TERMINATED = 128 + signal.SIGTERM  # as a shell reports a command SIGTERM ended
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C, as a shell reports it


def result_file(job: str) -> str:
    """The job's completion marker in `--out`: present only after a complete run."""
    return f"result-{job}.json"


@contextlib.contextmanager
def _sigterm_as_interrupt(terminated: list[bool]) -> Iterator[None]:
    """SIGTERM (a scheduler's timeout) stops the jobs as Ctrl-C does: pyspark's SIGINT
    handler cancels the running Spark jobs, and the runner says what was left incomplete
    before Spark stops. Without it the process died at once, silently. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        terminated.append(True)
        on_interrupt = signal.getsignal(signal.SIGINT)
        if callable(on_interrupt):  # pyspark's: cancels the Spark jobs, raises KeyboardInterrupt
            on_interrupt(signal.SIGINT, frame)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_text(
    jobs: Sequence[SparkJob], current: SparkJob | None, out: str, term: bool
) -> str:
    """One line for a run stopped by Ctrl-C or SIGTERM: the job it stopped, whose
    outputs are no complete run (no completion marker), and the jobs never started."""
    how = "terminated (SIGTERM)" if term else "interrupted"
    if current is None:
        return f"pushgw spark: {how}"
    names = [job.name for job in jobs]
    later = names[names.index(current.name) + 1 :]
    text = (
        f"pushgw spark: {how} during {current.name}: its outputs in {out} are not a "
        f"complete run (no {result_file(current.name)})"
    )
    return text + (f"; not run: {', '.join(later)}" if later else "")


def finish(spark: Any, out: str, result: JobResult, started: float) -> None:
    """What every job's run ends with, done here for a job that did not do it itself
    (the built-in jobs call `report_bad_input` and `write_result`): the skipped lines on
    stderr, the run time and `result-<job>.json` beside the job's outputs. Each is
    checked on its own: a job that wrote its result file still gets its skipped lines
    printed, once."""
    report_bad_input(result.input)  # a no-op when the job printed them
    if f"result-{result.job}.json" in result.outputs:
        return
    write_result(spark, out, result, started)


def failure_text(exc: Exception) -> str:
    """A job's error in one line: its message without the Java stack trace that Py4J
    appends (`at ...` frames; Spark's log above holds the executors' own). A Python
    error of the job's own code (`KeyError: 'top'`) is named by its kind, which its
    message alone often does not say."""
    lines = []
    for line in str(exc).splitlines():
        line = line.strip().lstrip(": ")
        if not line:
            continue
        if line.startswith("at ") or (line.startswith("...") and line.endswith("more")):
            break  # the frames start: what follows is trace, not message
        lines.append(line)
    text = " ".join(lines)
    module = type(exc).__module__.split(".")[0]
    if type(exc) in (Exception, RuntimeError, JobContractError) or module in ("pyspark", "py4j"):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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

    With `job_name` the job of that name runs (a built-in one without loading any other
    plugin; a third-party plugin's own entry script names its job the same way);
    without, the positional arguments name one or more jobs from any installed plugin,
    run in one session.
    """
    parser = argparse.ArgumentParser(
        prog=job_name or "run_job", description="Run pushgw Spark jobs (spark-submit entry)."
    )
    if job_name is None:
        parser.add_argument("jobs", nargs="+", metavar="JOB", help="job name(s), in order")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if job_name is not None:
        from spark_plugins.builtin import BUILTIN_JOBS

        known = {job.name: job for job in BUILTIN_JOBS}
        if job_name not in known:  # a plugin's job: found as `run_job.py JOB` finds it
            known = discover_jobs()
        names = [job_name]
    else:
        known = discover_jobs()
        names = args.jobs
    jobs = select_jobs(known, names)
    if jobs is None:
        return 2
    try:
        status, _ = run_jobs(jobs, args.receipts, args.out, args.option)
    except KeyboardInterrupt:
        # Ctrl-C (spark-submit's process group): `run_jobs` said in one line what it
        # left incomplete; a traceback after it would bury that line. 130, as
        # `pushgw spark run` and a shell report it.
        return EXIT_INTERRUPTED
    return status


def select_jobs(known: dict[str, SparkJob], names: Sequence[str]) -> list[SparkJob] | None:
    """The jobs named, in order; None (and a message) when a name is unknown."""
    unknown = [name for name in names if name not in known]
    if unknown:
        listing = ", ".join(sorted(known)) or "none"
        print(f"pushgw spark: unknown job {unknown[0]!r} (known: {listing})", file=sys.stderr)
        return None
    return [known[name] for name in names]
