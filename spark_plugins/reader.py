"""Reading delivery receipts (docs/receipts.md) into a DataFrame, skipping bad lines.

Input: every `*.jsonl` file under the receipts directory, recursively (so never the
`*.jsonl.open` files still being written), and every `*.parquet` file (Parquet rollover).
The schema is the documented one, given explicitly: nothing is inferred, unknown fields
are ignored, as the compatibility rules of docs/receipts.md ask.

Bad input is never fatal. A line is skipped and counted when it is not a JSON object
(malformed, truncated), when a required field is missing or has the wrong type,
or when its schema version `v` is not 1. Empty lines are ignored. Counting costs
nothing extra: an `Observation` collects the number of lines, of bad lines and the set
of files holding them during the job's own first pass over the data.

Line numbers. Spark reads a large file as several splits, possibly in different tasks,
so a row's position in its task is not its line number. When (and only when) bad lines
exist, a second pass reads just the affected files as text with three columns:
`_metadata.file_path`, `_metadata.file_block_start` (the byte offset of the split the
line was read from) and `monotonically_increasing_id()` (increasing in read order within
a task, and a split is read start to end by one task). Within one file, ordering by
(split offset, id) is therefore the file's line order, and `row_number()` over a window
partitioned by file gives the exact 1-based line number: Hadoop's line reader assigns a
line straddling a split boundary to the split where it starts, so no line is counted
twice or lost. This is computed in one Spark action, so the ids cannot change between
the numbering and the filtering. Parquet rows have no line: their file is reported.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from spark_plugins.jobs import BadLine, InputStats

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
SNIPPET = 200  # characters of a bad line shown in reports

STATUSES = ("ok", "token_invalid", "permanent", "auth", "throttled", "transient")


def display_path(uri: str) -> str:
    """`file:/x/y%20z.jsonl` -> `/x/y z.jsonl`; other URIs unchanged."""
    if uri.startswith("file:"):
        return unquote(urlparse(uri).path)
    return uri


def is_local(path: str) -> bool:
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def _local(path: str) -> str:
    return unquote(urlparse(path).path) if path.startswith("file:") else path


def receipts_problem(path: str) -> str | None:
    """What is wrong with a local receipts directory (missing, not a directory, not
    readable), or None; None for a Hadoop URI, which only Spark can look at."""
    if not is_local(path):
        return None
    local = _local(path)
    if not os.path.exists(local):
        return f"receipts directory not found: {path}"
    if not os.path.isdir(local):
        return f"receipts path is not a directory: {path}"
    if not os.access(local, os.R_OK | os.X_OK):
        return f"receipts directory is not readable: {path}"
    return None


@dataclass
class Receipts:
    """The valid receipts of a directory (`df`) and, after a first action on it, `stats()`."""

    spark: SparkSession
    path: str
    df: DataFrame
    files: list[str]
    _observation: Observation | None
    _text: DataFrame | None  # the JSON Lines source as text, for locating bad lines
    max_reported: int = 100
    _stats: InputStats | None = None

    def stats(self) -> InputStats:
        """Counts of the pass that already ran over `df`, plus the located bad lines.

        Call only after an action consumed `df` (otherwise this runs one itself).
        """
        if self._stats is not None:
            return self._stats
        stats = InputStats(files=len(self.files))
        if self._observation is not None:
            metrics = self._observation.get
            lines = int(metrics.get("lines") or 0)
            stats.bad = int(metrics.get("bad") or 0)
            stats.records = lines - stats.bad
            stats.bad_files = sorted(display_path(f) for f in (metrics.get("bad_files") or []))
            if stats.bad:
                stats.bad_lines = self._locate(list(metrics.get("bad_files") or []))
        self._stats = stats
        return stats

    def _locate(self, bad_files: list[str]) -> list[BadLine]:
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        found: list[BadLine] = []
        if self._text is not None and self.max_reported > 0:
            window = Window.partitionBy("_file").orderBy("_block", "_row")
            located = (
                self._text.filter(F.col("_file").isin(bad_files))
                .withColumn("_line", F.row_number().over(window))
                .filter(F.trim("value") != "")  # empty lines are ignored, as in the count
                .withColumn("r", F.from_json("value", _JSON_DDL, _JSON_OPTIONS))
                .filter(_bad_json(F.col("r")))
                .select("_file", "_line", F.substring("value", 1, SNIPPET).alias("text"))
                .orderBy("_file", "_line")
                .limit(self.max_reported)
            )
            found = [
                BadLine(display_path(row["_file"]), int(row["_line"]), row["text"])
                for row in located.collect()
            ]
        # Parquet files with bad rows: no line numbers, the file itself is reported.
        for uri in bad_files:
            if uri.endswith(".parquet") and len(found) < self.max_reported:
                found.append(BadLine(display_path(uri), None, "(row with a missing field)"))
        return found


def _bad_record(r: Column) -> Column:
    """True for a parsed record that is unusable: a required field null, or v != 1."""
    from pyspark.sql import functions as F

    missing = F.lit(False)
    for name in REQUIRED:
        missing = missing | r[name].isNull()
    return missing | (r["v"] != F.lit(SCHEMA_VERSION))


def _bad_json(r: Column) -> Column:
    return r.isNull() | r[_CORRUPT].isNotNull() | _bad_record(r)


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
    text_source: DataFrame | None = None

    text = _reader(spark, "*.jsonl").text(path)
    json_files = text.inputFiles()
    if json_files:
        files += json_files
        text_source = text.select(
            "value",
            F.col("_metadata.file_path").alias("_file"),
            F.col("_metadata.file_block_start").alias("_block"),
            F.monotonically_increasing_id().alias("_row"),
        )
        # Spark's JSON source (2-3x faster than text + from_json: it parses straight
        # from the bytes and converts only the columns a job uses). Empty lines are no
        # records for it; they are ignored, not counted.
        parsed = _reader(spark, "*.jsonl").schema(_JSON_DDL).options(**_JSON_OPTIONS).json(path)
        record = F.struct(*[F.col(c) for c in (*COLUMNS, _CORRUPT)])
        parts.append(
            parsed.select(
                *COLUMNS,
                F.col("_metadata.file_path").alias("_file"),
                _bad_json(record).alias("_bad"),
            )
        )

    parquet = _reader(spark, "*.parquet").schema(RECEIPT_DDL).parquet(path)
    parquet_files = parquet.inputFiles()
    if parquet_files:
        files += parquet_files
        r = F.struct(*[F.col(c) for c in COLUMNS])
        parts.append(
            parquet.select(
                *COLUMNS,
                F.col("_metadata.file_path").alias("_file"),
                _bad_record(r).alias("_bad"),
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
        combined = combined.observe(
            observation,
            F.count(F.lit(1)).alias("lines"),
            F.sum(F.col("_bad").cast("long")).alias("bad"),
            F.collect_set(F.when(F.col("_bad"), F.col("_file"))).alias("bad_files"),
        )
        df = combined.filter(~F.col("_bad")).select(*COLUMNS)
    return Receipts(spark, path, df, files, observation, text_source, max_reported)


def report_bad_input(stats: InputStats, stream: Any = None) -> None:
    """Print the skipped lines (file:line) to stderr, as operators see them."""
    stream = stream or sys.stderr
    if not stats.bad:
        return
    print(
        f"pushgw spark: skipped {stats.bad} bad receipt line(s) in {len(stats.bad_files)} file(s):",
        file=stream,
    )
    for bad in stats.bad_lines:
        where = f"{bad.file}:{bad.line}" if bad.line is not None else bad.file
        print(f"  {where}: {bad.text[:80]!r}", file=stream)
    if stats.bad > len(stats.bad_lines):
        print(f"  ... and {stats.bad - len(stats.bad_lines)} more", file=stream)
