"""The Spark job contract: `SparkJob`, its options, and `JobResult`.

A Spark job is a plain object returned by the `pushgw_spark_jobs` hook of any plugin
(built-in or third-party). This module never imports pyspark: listing jobs and
parsing their options works without Spark installed; only `SparkJob.run` needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class OptionError(ValueError):
    """An unknown job option or a value of the wrong type (CLI exit status 2)."""


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


_PARSERS: dict[type, Callable[[str], Any]] = {
    int: int,
    float: float,
    str: str,
    bool: _parse_bool,
    tuple: _parse_list,
}


@dataclass(frozen=True)
class JobOption:
    """One option of a job: `--option name=value` on the command line.

    `type` is one of `int`, `float`, `str`, `bool` or `tuple` (a comma-separated list
    of strings); `default` is the value used when the option is not given (None means
    "not set", which the job interprets, e.g. "use the end of the data").
    """

    name: str
    type: type
    default: Any
    help: str

    def parse(self, text: str) -> Any:
        try:
            return _PARSERS[self.type](text)
        except (ValueError, KeyError) as exc:
            raise OptionError(f"option {self.name}: {exc}") from None


@dataclass
class BadLine:
    """A receipt line that was skipped: where it is and why."""

    file: str
    line: int | None  # 1-based line number (JSON Lines); None for Parquet rows
    text: str  # the start of the line (receipts hold no secrets, only keyed hashes)


@dataclass
class InputStats:
    """What was read: records used, records skipped and where the skipped ones are."""

    files: int = 0
    records: int = 0
    bad: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)  # at most `max_reported`
    bad_files: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "records": self.records,
            "bad": self.bad,
            "bad_files": list(self.bad_files),
            "bad_lines": [{"file": b.file, "line": b.line, "text": b.text} for b in self.bad_lines],
        }


@dataclass
class JobResult:
    """What a job produced: output files (paths or URIs) and a few headline numbers."""

    job: str
    outputs: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    input: InputStats = field(default_factory=InputStats)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "outputs": dict(self.outputs),
            "metrics": dict(self.metrics),
            "input": self.input.as_dict(),
            "seconds": round(self.seconds, 3),
        }


RunFn = Callable[["SparkSession", str, str, Mapping[str, Any]], JobResult]


def with_sql_conf(
    settings: Callable[[Mapping[str, Any]], Mapping[str, str]],
) -> Callable[[RunFn], RunFn]:
    """Decorate a job's `run` so that the Spark SQL `settings(options)` hold for its run only.

    Jobs share a session (`pushgw spark run JOB JOB`); what was set before is put back
    afterwards (`spark_plugins.session.sql_conf`). `run.__wrapped__` is the job without
    them, for measuring what they are worth.
    """

    def decorate(run: RunFn) -> RunFn:
        @functools.wraps(run)
        def tuned(
            spark: SparkSession, receipts_dir: str, out_dir: str, options: Mapping[str, Any]
        ) -> JobResult:
            from spark_plugins.session import sql_conf

            with sql_conf(spark, settings(options)):
                return run(spark, receipts_dir, out_dir, options)

        return tuned

    return decorate


@dataclass(frozen=True)
class SparkJob:
    """A batch job over delivery receipts, contributed by a plugin's `pushgw_spark_jobs` hook.

    - `name`: the command-line name (`pushgw spark run NAME`), unique across plugins.
    - `description`: one line for `pushgw spark list`.
    - `run(spark, receipts_dir, out_dir, options) -> JobResult`: does the work.
      `receipts_dir` and `out_dir` are paths or Hadoop URIs (`hdfs://`, `s3a://`...);
      `options` holds every declared option, defaults filled in (see `resolve_options`).
    - `options`: the declared `JobOption`s.
    - `submit_script`: the plain `spark-submit` entry script of the job, if it ships one.
    """

    name: str
    description: str
    run: RunFn
    options: tuple[JobOption, ...] = ()
    submit_script: str | None = None

    def defaults(self) -> dict[str, Any]:
        return {opt.name: opt.default for opt in self.options}

    def resolve_options(self, given: Mapping[str, Any] | Iterable[str] = ()) -> dict[str, Any]:
        """Defaults overlaid with `given` (a mapping, or `k=v` strings from the command line).

        String values are parsed with the option's type; unknown names raise `OptionError`.
        """
        by_name = {opt.name: opt for opt in self.options}
        pairs: list[tuple[str, Any]] = []
        if isinstance(given, Mapping):
            pairs = list(given.items())
        else:
            for item in given:
                key, sep, value = item.partition("=")
                if not sep:
                    raise OptionError(f"option {item!r}: expected NAME=VALUE")
                pairs.append((key.strip(), value))
        resolved = self.defaults()
        for key, value in pairs:
            opt = by_name.get(key)
            if opt is None:
                known = ", ".join(sorted(by_name)) or "none"
                raise OptionError(f"job {self.name}: unknown option {key!r} (known: {known})")
            resolved[key] = opt.parse(value) if isinstance(value, str) else value
        return resolved


def collect_jobs(results: Iterable[Any]) -> dict[str, SparkJob]:
    """Flatten `pushgw_spark_jobs` hook results into name -> job; duplicate names are errors."""
    jobs: dict[str, SparkJob] = {}
    for result in results:
        if result is None:
            continue
        for job in result:
            if not all(hasattr(job, a) for a in ("name", "description", "run")):
                raise TypeError(f"not a SparkJob: {job!r}")
            if job.name in jobs:
                raise ValueError(f"two plugins define the Spark job {job.name!r}")
            jobs[job.name] = job
    return jobs
