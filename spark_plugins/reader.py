"""Reading delivery receipts (docs/receipts.md) into a DataFrame, skipping bad input.

Input: every `*.jsonl` file under the receipts directory, recursively (so never the
`*.jsonl.open` files still being written), and every `*.parquet` file (Parquet rollover).
The directory is the one named, even when its name holds characters Hadoop's glob would
expand, such as `r[1]` (`literal_path`).
The schema is the documented one, given explicitly: nothing is inferred, unknown fields
are ignored, as the compatibility rules of docs/receipts.md ask.

Bad input is never fatal. A record is skipped and counted when its line is not JSON
(malformed, truncated), when a required field is missing or has the wrong type, when its
schema version `v` is not 1, or when a value is implausible (`_problems`: `ts` not a
finite unix time in seconds from 2000 to 2099, `latency_ms` negative, not finite or
above 30 days, `attempts` negative or above 2,147,483,647, `http_status` negative or
above 999). Empty lines are ignored. Counting costs nothing extra: an `Observation`
collects the number of records, of bad ones and the set of files holding them during
the job's own first pass over the data.

Spark's JSON source reads a line holding a JSON array of objects as one record per
element (and `[]` as none); nothing cheap tells such records apart from one-object
lines, so they are read like any other record, and `_locate` lists such a line when one
of its elements is bad, as the count has it.

A Parquet file Spark cannot read (truncated, or a receipt column stored with a type it
cannot read as the documented one, e.g. `ts` as a string) would fail the whole job; it
is skipped and reported instead. For a local directory, each file's footer is read with
pyarrow before the job (well under a millisecond per file, several at a time), and a bad
file is left out of every job alike (`parquet_files.check_local_files`). On any file
system, the Parquet read runs with Spark's `ignoreCorruptFiles`, and the observation
notes each Parquet file whose first row (`_metadata.row_index` 0) was read; a listed
file that gave no row and was not left out already is looked at afterwards through
Hadoop (`parquet_files.recheck_file`) and reported unless it is a valid file with no
rows. That covers HDFS and S3, where reading every footer from the driver would cost a
request per file, at no cost while all is well.

Line numbers. Spark reads a large file as several splits, possibly in different tasks,
so a row's position in its task is not its line number. When (and only when) bad lines
exist, a second pass lists the directory again and reads just the affected files (the
filter on the file path comes before the id, so Spark prunes the others) as text with
three columns:
`_metadata.file_path`, `_metadata.file_block_start` (the byte offset of the split the
line was read from) and `monotonically_increasing_id()` (increasing in read order within
a task, and a split is read start to end by one task). Within one file, ordering by
(split offset, id) is therefore the file's line order, and `row_number()` over a window
partitioned by file gives the exact 1-based line number: Hadoop's line reader assigns a
line straddling a split boundary to the split where it starts, so no line is counted
twice or lost. This is computed in one Spark action, so the ids cannot change between
the numbering and the filtering. Parquet rows have no line: their file is reported, with
what was wrong with its rows.

Listing. Each source lists the tree once, when it is made (the JSON Lines and the
Parquet one; the text one only when bad lines are located): the files reported are the
ones the counted source listed, so a file published meanwhile is read whole or not at
all. A local tree is listed by the driver, not by a Spark job of a task per
subdirectory (`_listing`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spark_plugins import parquet_files
from spark_plugins.jobs import JAVA_INT_MAX, BadLine, InputStats, JobOption
from spark_plugins.parquet_files import SkippedFile
from spark_plugins.paths import display_path, is_local, uri_path

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, Observation, SparkSession

SCHEMA_VERSION = 1

# The documented record, in documented order (docs/receipts.md). Integers are read as
# LONG so that Parquet files written by Arrow (int64) and JSON both fit.
RECEIPT_FIELDS: tuple[tuple[str, str], ...] = (
    ("v", "LONG"),
    ("ts", "DOUBLE"),
    ("push_id", "STRING"),
    ("plugin", "STRING"),
    ("app_id", "STRING"),
    ("provider", "STRING"),
    ("status", "STRING"),
    ("http_status", "LONG"),
    ("reason", "STRING"),
    ("attempts", "LONG"),
    ("latency_ms", "DOUBLE"),
    ("token_hash", "STRING"),
)
REQUIRED = ("v", "ts", "push_id", "plugin", "app_id", "status", "attempts", "latency_ms")
COLUMNS = tuple(name for name, _ in RECEIPT_FIELDS)
RECEIPT_DDL = ", ".join(f"{name} {kind}" for name, kind in RECEIPT_FIELDS)
_CORRUPT = "_corrupt_record"
_JSON_DDL = f"{RECEIPT_DDL}, {_CORRUPT} STRING"
_JSON_OPTIONS = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT}
# A line holding a JSON array, parsed as Spark's JSON source reads it (one record each)
_ARRAY_DDL = "ARRAY<STRUCT<" + ", ".join(f"{n}: {k}" for n, k in RECEIPT_FIELDS) + ">>"
# Off while locating: an element with a field of the wrong type then makes its array
# line null (bad), as it makes the JSON source's record corrupt.
_JSON_PARTIAL_RESULTS = "spark.sql.json.enablePartialResults"
SNIPPET = 200  # characters of a bad line shown in reports

# Plausible receipt times, unix seconds (UTC): 2000-01-01 <= ts < 2100-01-01. Outside is
# a unit mistake (milliseconds, microseconds), an unset clock (0) or garbage, which the
# jobs cannot use: they turn `ts` into timestamps and hours (1e20 overflows, a receipt
# in 1970 or in milliseconds makes an hourly series of millions of hours).
TS_MIN = 946_684_800.0  # 2000-01-01T00:00:00Z
TS_MAX = 4_102_444_800.0  # 2100-01-01T00:00:00Z
# Upper bounds of the other numbers. Beyond them a value is garbage, not a receipt, and
# would break the jobs: sums of `attempts` overflow a long ([ARITHMETIC_OVERFLOW]: two
# receipts of 2**62 + 1 suffice) and sums of `latency_ms` a double (a mean of Infinity;
# 1.7e308 also breaks the chart). Within them, sums stay far from overflowing: ten
# million receipts at the bound sum to about 2.1e16 attempts (a long holds 9.2e18) and
# 2.6e16 ms.
ATTEMPTS_MAX = 2_147_483_647  # Java's int max: a push is never retried that often
HTTP_STATUS_MAX = 999  # HTTP status codes have three digits
# 30 days in milliseconds: the gateway never holds a push that long (its deadlines are
# minutes to hours)
LATENCY_MS_MAX = 2_592_000_000.0

# Every built-in job's option for how many bad lines it lists (`Receipts.max_reported`).
MAX_BAD_LINES = JobOption(
    "max_bad_lines",
    int,
    100,
    "bad receipt lines reported with file and line (0: counted only)",
    minimum=0,
    maximum=JAVA_INT_MAX,
)

STATUSES = ("ok", "token_invalid", "permanent", "auth", "throttled", "transient")


def receipts_problem(path: str) -> str | None:
    """What is wrong with a local receipts directory (missing, not a directory, not
    readable), or None; None for a Hadoop URI, which only Spark can look at."""
    if not is_local(path):
        return None
    local = uri_path(path)
    if not os.path.exists(local):
        return f"receipts directory not found: {path}"
    if not os.path.isdir(local):
        return f"receipts path is not a directory: {path}"
    if not os.access(local, os.R_OK | os.X_OK):
        return f"receipts directory is not readable: {path}"
    twice = _reached_twice(local)
    if twice:
        return f"receipts directory {path}: {twice}"
    return None


def _spark_skips(name: str) -> bool:
    """Whether Spark's file listing leaves out a file or directory of this name (Spark's
    `HadoopFSUtils.shouldFilterOutPathName`): hidden and `_`-prefixed names."""
    return (name.startswith("_") and "=" not in name) or name.startswith(".")


def _reached_twice(root: str) -> str | None:
    """A directory Spark's recursive listing would reach twice through a symbolic link,
    in words, or None. Spark follows links to directories: a link back up the tree
    (`current -> .`) has it read every file below once per level until the path is too
    long, and a second route to a directory reads its files twice; every count of every
    job would be that many times too large. A link to a receipts file read anyway is the
    same: that file read twice, and so is a hard link to one (a `cp -al` snapshot kept
    in the tree). Directories and files are told apart by device and inode."""
    seen: dict[tuple[int, int], str] = {}
    files: dict[tuple[int, int], str] = {}  # each receipts file -> as listed
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            info = os.stat(directory)
        except OSError:  # gone, or not searchable: Spark's listing reports it
            continue
        real = (info.st_dev, info.st_ino)
        if real in seen:
            return (
                f"{directory} is {seen[real]} again (a symbolic link leads there): "
                "its receipts would be read twice"
            )
        seen[real] = directory
        try:
            entries = list(os.scandir(directory))
        except OSError:  # unreadable below the top: Spark's listing reports it
            continue
        for entry in sorted(entries, key=lambda e: e.name, reverse=True):
            if _spark_skips(entry.name):
                continue
            listed = os.path.join(directory, entry.name)
            try:
                if entry.is_dir():  # through a link too, as Spark lists it
                    stack.append(listed)
                    continue
                if not entry.name.endswith((".jsonl", ".parquet")):
                    continue
                stat = entry.stat()  # through a symbolic link: the file it leads to
            except OSError:  # a dangling link: Spark lists nothing there either
                continue
            file = (stat.st_dev, stat.st_ino)
            if file in files:
                return (
                    f"{listed} and {files[file]} are the same file (a symbolic or hard "
                    "link): its receipts would be read twice"
                )
            files[file] = listed
    return None


@dataclass
class Receipts:
    """The valid receipts of a directory (`df`) and, after a first action on it, `stats()`."""

    spark: SparkSession
    path: str
    df: DataFrame
    files: list[str]
    _observation: Observation | None
    max_reported: int = 100
    _parquet_files: list[str] = field(default_factory=list)  # listed, as URIs
    _skipped: dict[str, SkippedFile] = field(default_factory=dict)  # by display path
    _empty: set[str] = field(default_factory=set)  # valid Parquet files without rows
    _stats: InputStats | None = None

    def stats(self) -> InputStats:
        """Counts of the pass that already ran over `df`, plus the located bad lines.

        Call only after an action consumed all of `df`: before any, it waits for one
        (pyspark's `Observation.get` blocks until the observed DataFrame has run);
        after one that read part of it, such as a `limit`, the counts are partial and
        unread Parquet files look skipped.
        """
        if self._stats is not None:
            return self._stats
        stats = InputStats(files=len(self.files))
        skipped = dict(self._skipped)
        bad_files: list[str] = []
        reasons: dict[str, set[str]] = {}
        bad = 0
        if self._observation is not None:
            metrics = observed_metrics(self._observation)
            lines = int(metrics.get("lines") or 0)
            bad = int(metrics.get("bad") or 0)
            stats.records = lines - bad
            bad_files = list(metrics.get("bad_files") or [])
            for row in metrics.get("parquet_bad") or []:
                reasons.setdefault(row[0], set()).add(row[1])
            read = {display_path(uri) for uri in metrics.get("parquet_read") or []}
            for uri in self._parquet_files:
                shown = display_path(uri)
                if shown in read or shown in skipped or shown in self._empty:
                    continue
                problem = parquet_files.recheck_file(self.spark, uri)
                if problem is not None:
                    skipped[shown] = problem
        stats.bad = bad + sum(s.rows for s in skipped.values())
        stats.bad_files = sorted({display_path(f) for f in bad_files} | set(skipped))
        found: list[BadLine] = []
        lines_listed_all = True
        if bad:
            line_files = [f for f in bad_files if not f.endswith(".parquet")]
            found = self._locate(line_files)
            # `_locate` finds one more than it lists: then the listing is cut
            lines_listed_all = not line_files or self.max_reported > 0
        # Parquet rows have no line number: their file is reported, with what was wrong.
        for uri in sorted(reasons, key=display_path):
            text = "(rows skipped: " + "; ".join(sorted(reasons[uri])) + ")"
            found.append(BadLine(display_path(uri), None, text))
        for shown in sorted(skipped):
            found.append(BadLine(shown, None, f"({skipped[shown].text})"))
        stats.bad_lines = found[: self.max_reported]
        stats.listed_all = lines_listed_all and len(found) <= self.max_reported
        self._stats = stats
        return stats

    def _locate(self, bad_files: list[str]) -> list[BadLine]:
        """The bad lines of these JSON Lines files, by the rules of the counting pass."""
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        from spark_plugins.session import sql_conf

        if self.max_reported <= 0 or not bad_files:
            return []
        # Only the affected files are read: the filter on the file comes before the
        # (nondeterministic) id, which Spark would not push a filter through, so that it
        # prunes the listing instead of reading every JSON Lines file again as text.
        with _listing(self.spark, self.path):
            text = _reader(self.spark, "*.jsonl").text(literal_path(self.path))
        in_order = text.filter(F.col("_metadata.file_path").isin(bad_files)).select(
            "value",
            F.col("_metadata.file_path").alias("_file"),
            F.col("_metadata.file_block_start").alias("_block"),
            F.monotonically_increasing_id().alias("_row"),
        )
        value = F.col("value")
        elements = F.from_json(value, _ARRAY_DDL)
        record = F.from_json(value, _JSON_DDL, _JSON_OPTIONS)
        bad = F.when(
            value.rlike(r"^[ \t\r]*\["),  # an array: Spark's JSON source reads each element
            elements.isNull() | F.exists(elements, lambda r: r.isNull() | _bad_record(r)),
        ).otherwise(_bad_json(record))
        window = Window.partitionBy("_file").orderBy("_block", "_row")
        located = (
            in_order.withColumn("_line", F.row_number().over(window))
            .filter(~value.rlike(r"^[ \t\r]*$"))  # empty lines are ignored, as in the count
            .filter(bad)
            .select("_file", "_line", F.substring("value", 1, SNIPPET).alias("text"))
            .orderBy("_file", "_line")
            .limit(self.max_reported + 1)  # one more: whether the listing is cut
        )
        with sql_conf(self.spark, {_JSON_PARTIAL_RESULTS: "false"}):
            rows = located.collect()
        return [BadLine(display_path(row["_file"]), int(row["_line"]), row["text"]) for row in rows]


def observed_metrics(observation: Observation) -> dict[str, Any]:
    """The observed metrics; {} when the pass read no row (every file left out or empty:
    Spark then has an empty row, which `Observation.get` cannot convert)."""
    try:
        return observation.get
    except Exception:
        handle = getattr(observation, "_jo", None)
        if handle is not None and handle.getRow().length() == 0:
            return {}
        raise


def _problems(r: Column) -> list[tuple[Column, str]]:
    """What makes a parsed record unusable, each with the words a report uses for it."""
    from pyspark.sql import functions as F

    missing = F.lit(False)
    for name in REQUIRED:
        missing = missing | r[name].isNull()
    ts, latency = r["ts"], r["latency_ms"]
    # Spark orders NaN above every number, +Infinity included: each range test below
    # is false for NaN and for an infinity, with no test of its own. The first problem
    # of a record names it (`_bad_reason`): the upper bounds come after the tests for
    # not finite, so Infinity is "not finite", not "above".
    http_status = r["http_status"]
    return [
        (missing, "a required field is missing"),
        (r["v"] != F.lit(SCHEMA_VERSION), f"schema version v is not {SCHEMA_VERSION}"),
        (
            ~((ts >= F.lit(TS_MIN)) & (ts < F.lit(TS_MAX))),
            "ts is not a unix time in seconds from 2000 to 2099",
        ),
        (
            ~((latency >= F.lit(0.0)) & (latency < F.lit(float("inf")))),
            "latency_ms is negative or not finite",
        ),
        (latency > F.lit(LATENCY_MS_MAX), f"latency_ms is above {LATENCY_MS_MAX:.0f} (30 days)"),
        (r["attempts"] < F.lit(0), "attempts is negative"),
        (r["attempts"] > F.lit(ATTEMPTS_MAX), f"attempts is above {ATTEMPTS_MAX}"),
        # Also makes every job parse `http_status`, the one optional field a JSON value
        # can have the wrong type for (a string field takes any value as its text): Spark
        # converts only the fields a query uses, so that record would be bad for one job
        # and good for the next.
        (http_status.isNotNull() & (http_status < F.lit(0)), "http_status is negative"),
        (
            http_status.isNotNull() & (http_status > F.lit(HTTP_STATUS_MAX)),
            f"http_status is above {HTTP_STATUS_MAX}",
        ),
    ]


def _bad_record(r: Column) -> Column:
    """True for a parsed record that is unusable (`_problems`)."""
    from pyspark.sql import functions as F

    bad = F.lit(False)
    for condition, _ in _problems(r):
        bad = bad | condition
    return bad


def _bad_reason(r: Column) -> Column:
    """The first of `_problems` a record has, in words (null for a good record)."""
    from pyspark.sql import functions as F

    problems = _problems(r)
    reason = F.when(problems[0][0], F.lit(problems[0][1]))
    for condition, words in problems[1:]:
        reason = reason.when(condition, F.lit(words))
    return reason


def _bad_json(r: Column) -> Column:
    return r.isNull() | r[_CORRUPT].isNotNull() | _bad_record(r)


# Hadoop's glob metacharacters (`GlobPattern`): Spark's file sources expand a path
# holding one as a pattern, so a directory named `r[1]` would be looked for as `r1`.
_GLOB_CHARS = frozenset("\\[]{}*?")


def literal_path(path: str) -> str:
    """`path` as Spark's file sources take it literally: each glob metacharacter escaped
    with a backslash, which Hadoop's glob honours (`r[1]` -> `r\\[1\\]`). The files Spark
    lists under it (`inputFiles`, `_metadata.file_path`) are named as usual, unescaped.
    A local path on Windows is left as it is: Hadoop turns its backslashes into `/`."""
    if os.name == "nt" and is_local(path):
        return path
    return "".join("\\" + c if c in _GLOB_CHARS else c for c in path)


# Spark lists a directory of more than this many subdirectories (a node's day
# directories) with a Spark job of one task per subdirectory, which pays on HDFS or S3.
_PARALLEL_LISTING = "spark.sql.sources.parallelPartitionDiscovery.threshold"


@contextmanager
def _listing(spark: SparkSession, path: str) -> Iterator[None]:
    """Have the sources made inside list `path`'s tree on the driver when it is local:
    listing a local directory takes well under a millisecond, a task of a listing job
    far more, so `read_receipts` over 400 day directories of 5 files each took 4-7x
    longer with Spark's listing jobs (2 cores). A Hadoop URI keeps Spark's parallel
    listing, where each directory is a request."""
    from spark_plugins.session import sql_conf

    if not is_local(path):
        yield
        return
    with sql_conf(spark, {_PARALLEL_LISTING: str(JAVA_INT_MAX)}):
        yield


def _reader(spark: SparkSession, glob: str) -> Any:
    return (
        spark.read.option("recursiveFileLookup", "true")
        .option("pathGlobFilter", glob)
        .option("ignoreMissingFiles", "true")  # a file rolled away under us is not fatal
    )


def read_receipts(spark: SparkSession, path: str, *, max_reported: int = 100) -> Receipts:
    """The receipts under `path` (a directory; local path or Hadoop URI).

    An empty directory (or one with no `*.jsonl` / `*.parquet` file) gives an empty
    DataFrame; a local path that is missing or no directory raises `FileNotFoundError`
    (`pushgw spark run` reports that before Spark starts: `receipts_problem`).
    """
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    problem = receipts_problem(path)
    if problem:
        raise FileNotFoundError(problem)

    parts: list[DataFrame] = []
    files: list[str] = []
    source = literal_path(path)  # the directory itself, never a pattern

    # Spark's JSON source (2-3x faster than text + from_json: it parses straight from
    # the bytes and converts only the columns a job uses). Empty lines are no records
    # for it; they are ignored, not counted. Each source lists the tree once, when it is
    # made: the files counted are the ones this listing found, and the text of the bad
    # lines' files is listed again only when there are some (`_locate`).
    with _listing(spark, path):
        parsed = _reader(spark, "*.jsonl").schema(_JSON_DDL).options(**_JSON_OPTIONS).json(source)
        # A file Spark cannot read is skipped, not fatal; which ones: module docstring.
        parquet = (
            _reader(spark, "*.parquet")
            .option("ignoreCorruptFiles", "true")
            .schema(RECEIPT_DDL)
            .parquet(source)
        )
    json_files = parsed.inputFiles()
    if json_files:
        files += json_files
        record = F.struct(*[F.col(c) for c in (*COLUMNS, _CORRUPT)])
        parts.append(
            parsed.select(
                *COLUMNS,
                F.col("_metadata.file_path").alias("_file"),
                _bad_json(record).alias("_bad"),
                F.lit(None).cast("string").alias("_why"),
                F.lit(False).alias("_first"),
            )
        )

    parquet_uris = parquet.inputFiles()
    skipped: dict[str, SkippedFile] = {}
    empty: set[str] = set()
    if parquet_uris:
        files += parquet_uris
        if is_local(path):
            case_sensitive = str(spark.conf.get("spark.sql.caseSensitive", "false")) == "true"
            skipped, empty = parquet_files.check_local_files(
                parquet_uris, dict(RECEIPT_FIELDS), case_sensitive
            )
    if len(skipped) < len(parquet_uris):  # something is left to read
        if skipped:
            # left out of every job alike, even one that reads none of the bad columns
            # (`_metadata.file_path` spells local files `file:/x`, listings `file:///x`)
            names = [s.uri for s in skipped.values()]
            names += ["file:/" + u[len("file:///") :] for u in names if u.startswith("file:///")]
            parquet = parquet.filter(~F.col("_metadata.file_path").isin(names))
        # what is wrong with a bad row, in words: a Parquet row has no line to show
        why = _bad_reason(F.struct(*[F.col(c) for c in COLUMNS]))
        parts.append(
            parquet.select(
                *COLUMNS,
                F.col("_metadata.file_path").alias("_file"),
                why.isNotNull().alias("_bad"),
                why.alias("_why"),
                (F.col("_metadata.row_index") == 0).alias("_first"),
            )
        )

    observation: Observation | None = None
    if not parts:
        df = spark.createDataFrame([], RECEIPT_DDL)
    else:
        combined = parts[0]
        for extra in parts[1:]:
            combined = combined.unionByName(extra)
        observation = Observation("pushgw_receipts_input")
        bad, why = F.col("_bad"), F.col("_why")
        combined = combined.observe(
            observation,
            F.count(F.lit(1)).alias("lines"),
            F.sum(bad.cast("long")).alias("bad"),
            F.collect_set(F.when(bad, F.col("_file"))).alias("bad_files"),
            F.collect_set(F.when(why.isNotNull(), F.struct("_file", "_why"))).alias("parquet_bad"),
            # the Parquet files Spark read (their first row): a missing one was skipped
            F.collect_set(F.when(F.col("_first"), F.col("_file"))).alias("parquet_read"),
        )
        df = combined.filter(~bad).select(*COLUMNS)
    return Receipts(
        spark,
        path,
        df,
        files,
        observation,
        max_reported,
        _parquet_files=list(parquet_uris),
        _skipped=skipped,
        _empty=empty,
    )


def report_bad_input(stats: InputStats, stream: Any = None) -> None:
    """Print the skipped lines (file:line) to stderr, as operators see them: once per
    `stats` (`InputStats.reported`), whether the job or the runner calls it first."""
    stream = stream or sys.stderr
    if not stats.bad or stats.reported:
        return
    stats.reported = True
    print(
        f"pushgw spark: skipped {stats.bad} bad receipt line(s) in {len(stats.bad_files)} file(s):",
        file=stream,
    )
    for bad in stats.bad_lines:
        where = f"{bad.file}:{bad.line}" if bad.line is not None else bad.file
        print(f"  {where}: {bad.text[:80]!r}", file=stream)
    if not stats.listed_all:
        print(f"  ... and more: {len(stats.bad_lines)} listed (option max_bad_lines)", file=stream)
