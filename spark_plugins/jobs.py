"""The Spark job contract: `SparkJob`, its options, and `JobResult`.

A Spark job is a plain object returned by the `pushgw_spark_jobs` hook of any plugin
(built-in or third-party). This module never imports pyspark: listing jobs and
parsing their options works without Spark installed; only `SparkJob.run` needs it.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


JAVA_INT_MAX = 2**31 - 1  # `maximum` of an option Spark takes as a Java int
# Every int option's range, whatever its own bounds: Spark holds a number as a Java long.
JAVA_LONG_MIN, JAVA_LONG_MAX = -(2**63), 2**63 - 1


class OptionError(ValueError):
    """An unknown job option or a value it does not accept (CLI exit status 2)."""


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean (true/false, yes/no, on/off, 1/0): {text!r}")


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if math.isnan(value):
        raise ValueError(f"not a number: {text!r}")
    return value


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


_PARSERS: dict[type, Callable[[str], Any]] = {
    int: _parse_int,
    float: _parse_float,
    str: str,
    bool: _parse_bool,
    tuple: _parse_list,
}


def _number(value: float) -> str:
    """`3.0` -> `3`, `0.5` -> `0.5`: bounds as people write them."""
    return str(int(value)) if float(value).is_integer() else str(value)


@dataclass(frozen=True)
class JobOption:
    """One option of a job: `--option name=value` on the command line.

    `type` is one of `int`, `float`, `str`, `bool` or `tuple` (a comma-separated list
    of strings); `default` is the value used when the option is not given (None means
    "not set", which the job interprets, e.g. "use the end of the data").

    What the option accepts (all optional, keyword-only; `validate` checks them, and
    `SparkJob.resolve_options` runs it on every value before Spark starts):

    - `choices`: the allowed values; for a `tuple` option, the allowed items.
    - `minimum` / `maximum`: inclusive bounds of an `int` or `float` option;
      `exclusive_minimum`: a bound the value must be greater than (`> 0`).
    - `check(value)`: anything else; raises `ValueError` (or `OptionError`) whose message
      says what is wrong, e.g. "duplicate column 'plugin'".

    A float option never accepts NaN, an int option no value beyond a Java long (Spark
    could not take it).
    """

    name: str
    type: type
    default: Any
    help: str
    _: KW_ONLY
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    check: Callable[[Any], object] | None = None

    def parse(self, text: str) -> Any:
        """`text` as this option's type, validated."""
        try:
            value = _PARSERS[self.type](text)
        except KeyError:
            raise OptionError(f"option {self.name}: unsupported type {self.type!r}") from None
        except ValueError as exc:
            raise OptionError(f"option {self.name}: {exc}") from None
        return self.validate(value)

    def validate(self, value: Any) -> Any:
        """`value` if this option accepts it (its choices, bounds and check), else `OptionError`.

        None is accepted when the default is None ("not set").
        """
        if value is None:
            if self.default is None:
                return None
            raise OptionError(f"option {self.name}: a value is required")
        if self.type is tuple and isinstance(value, list):
            value = tuple(value)
        items = value if self.type is tuple and isinstance(value, tuple) else (value,)
        for item in items:
            if self.choices and item not in self.choices:
                allowed = ", ".join(str(c) for c in self.choices)
                raise OptionError(f"option {self.name}: {item!r} is not one of {allowed}")
            if self.type in (int, float) and isinstance(item, int | float):
                self._check_bounds(item)
        if self.check is not None:
            try:
                self.check(value)
            except OptionError:
                raise
            except ValueError as exc:
                raise OptionError(f"option {self.name}: {exc}") from None
        return value

    def _check_bounds(self, value: float) -> None:
        if isinstance(value, float) and math.isnan(value):
            raise OptionError(f"option {self.name}: not a number: {value!r}")
        wrong = None
        if self.minimum is not None and value < self.minimum:
            wrong = f">= {_number(self.minimum)}"
        elif self.exclusive_minimum is not None and value <= self.exclusive_minimum:
            wrong = f"> {_number(self.exclusive_minimum)}"
        elif self.maximum is not None and value > self.maximum:
            wrong = f"<= {_number(self.maximum)}"
        elif self.type is int and value > JAVA_LONG_MAX:
            wrong = f"<= {JAVA_LONG_MAX}"
        elif self.type is int and value < JAVA_LONG_MIN:
            wrong = f">= {JAVA_LONG_MIN}"
        if wrong:
            raise OptionError(f"option {self.name}: must be {wrong}, not {value}")

    def accepts(self) -> str:
        """What the option accepts, for `pushgw spark list`: `sketch|exact|approx`,
        `>= 1`, `> 0, <= 1`...; empty when anything of its type goes."""
        parts = []
        if self.choices:
            parts.append("|".join(str(c) for c in self.choices))
        if self.minimum is not None:
            parts.append(f">= {_number(self.minimum)}")
        if self.exclusive_minimum is not None:
            parts.append(f"> {_number(self.exclusive_minimum)}")
        if self.maximum is not None:
            parts.append(f"<= {_number(self.maximum)}")
        return ", ".join(parts)


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
    # False when `bad_lines` stops at `max_reported` with more to list. Not `bad >
    # len(bad_lines)`: a Parquet file's entry stands for all the rows skipped in it.
    listed_all: bool = True
    # Set by `reader.report_bad_input` once it has printed them: the runner prints the
    # skipped lines of a job that did not, and never a second time those of one that did.
    reported: bool = field(default=False, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "records": self.records,
            "bad": self.bad,
            "bad_files": list(self.bad_files),
            "bad_lines": [{"file": b.file, "line": b.line, "text": b.text} for b in self.bad_lines],
            "listed_all": self.listed_all,
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


def progress(job: str, message: str, started: float | None = None, stream: Any = None) -> None:
    """One progress line of a running job on stderr, as the built-in jobs print them:
    `pushgw spark: JOB: [  12.3s] MESSAGE`, the time since `started` (a
    `time.monotonic()` taken when the job began), or without it when `started` is None.
    Flushed at once: a long run shows where it is while Spark works."""
    elapsed = "" if started is None else f"[{time.monotonic() - started:6.1f}s] "
    print(f"pushgw spark: {job}: {elapsed}{message}", file=stream or sys.stderr, flush=True)


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
      The runner then prints the skipped lines of `result.input`, sets `result.seconds`
      and writes `result-<job>.json`, unless the job did (`output.write_result`).
    - `options`: the declared `JobOption`s.
    - `submit_script`: the plain `spark-submit` entry script of the job, if it ships one.
    - `check(options)`: optional, for rules between options (each option's own rules are
      in its `JobOption`); called with the resolved options, raises `ValueError` (or
      `OptionError`) saying what is wrong.
    """

    name: str
    description: str
    run: RunFn
    options: tuple[JobOption, ...] = ()
    submit_script: str | None = None
    _: KW_ONLY
    check: Callable[[Mapping[str, Any]], object] | None = None

    def defaults(self) -> dict[str, Any]:
        return {opt.name: opt.default for opt in self.options}

    def resolve_options(self, given: Mapping[str, Any] | Iterable[str] = ()) -> dict[str, Any]:
        """Defaults overlaid with `given` (a mapping, or `k=v` strings from the command line).

        String values are parsed with the option's type; every value (defaults too) is
        validated (`JobOption.validate`), then the job's `check`. Unknown names and values
        an option does not accept raise `OptionError`, naming the job.
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
            try:
                resolved[key] = opt.parse(value) if isinstance(value, str) else value
            except OptionError as exc:
                raise OptionError(f"job {self.name}: {exc}") from None
        try:
            for opt in self.options:
                resolved[opt.name] = opt.validate(resolved[opt.name])
            if self.check is not None:
                self.check(resolved)
        except ValueError as exc:  # OptionError included
            raise OptionError(f"job {self.name}: {exc}") from None
        except Exception as exc:  # a bug in the job's check, not in the options given
            raise JobContractError(
                f"job {self.name}: its option check raised {type(exc).__name__}: {exc}"
            ) from exc
        return resolved


class JobContractError(RuntimeError):
    """A job broke the contract of `SparkJob`: its `run` returned no `JobResult`, or its
    `check` raised something other than `ValueError` (a bug of the job's)."""


def looks_like_job(obj: object) -> bool:
    """Whether `obj` has what the runner uses of a `SparkJob` (duck-typed: a plugin may
    bring its own class)."""
    return all(hasattr(obj, attr) for attr in ("name", "description", "run", "options"))


def collect_jobs(
    results: Iterable[Any], plugins: Sequence[str] | None = None
) -> dict[str, SparkJob]:
    """Flatten `pushgw_spark_jobs` hook results into name -> job; duplicate names are
    errors, naming both plugins when `plugins` (one name per result) is given."""
    jobs: dict[str, SparkJob] = {}
    owners: dict[str, str] = {}
    names = list(plugins) if plugins is not None else None
    for index, result in enumerate(results):
        if result is None:
            continue
        owner = names[index] if names is not None else ""
        for job in result:
            if not looks_like_job(job):
                raise TypeError(f"not a SparkJob: {job!r}")
            if job.name in jobs:
                if names is None:
                    raise ValueError(f"two plugins define the Spark job {job.name!r}")
                first, second = sorted((owners[job.name], owner))
                raise ValueError(
                    f"plugins {first!r} and {second!r} both define the Spark job {job.name!r}"
                )
            jobs[job.name], owners[job.name] = job, owner
    return jobs
