"""Parquet files Spark cannot read as a given schema, found before or after a job reads them.

`spark_plugins.reader` uses this to skip such a file and report it rather than let it
fail the whole job (see the reader's docstring): `check_local_files` reads the footers
of local files with pyarrow, `recheck_file` looks at one file through Hadoop (any file
system) after Spark read no row from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spark_plugins.paths import display_path, uri_path

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

NOT_PARQUET = "not a Parquet file, or truncated: file skipped"
SPARK_FAILED = "Spark could not read it (see its log): file skipped"


@dataclass(frozen=True)
class SkippedFile:
    """A Parquet file left out whole: why, and how many receipts that counts as."""

    uri: str
    text: str  # shown where a bad line's text would be, in parentheses
    rows: int = 1  # its row count when the footer tells it, else 1 (the file itself)


# How Spark 4 reads a Parquet column as each receipt type (checked against the installed
# Spark by tests/spark/test_bad_input.py): a LONG from INT32 (any integer annotation) or a
# signed INT64; a DOUBLE from DOUBLE, FLOAT or a plain or integer INT32 (not from INT64);
# a STRING from BYTE_ARRAY, plain or annotated as a string.
def _parquet_type_ok(kind: str, physical: str, logical: dict[str, Any]) -> bool:
    annotation = logical.get("Type", "None")
    if kind == "LONG":
        if physical == "INT32":
            return annotation in ("None", "Int")
        return physical == "INT64" and (
            annotation == "None" or (annotation == "Int" and logical.get("isSigned") is True)
        )
    if kind == "DOUBLE":
        if physical in ("DOUBLE", "FLOAT"):
            return annotation == "None"
        return physical == "INT32" and annotation in ("None", "Int")
    return physical == "BYTE_ARRAY" and annotation in ("None", "String")


def parquet_schema_problem(
    schema: Any, fields: Mapping[str, str], case_sensitive: bool = False
) -> str | None:
    """Why Spark cannot read `fields` (column name -> Spark type: LONG, DOUBLE, STRING)
    from a file of this Parquet schema (a pyarrow `ParquetSchema`), or None. Columns are
    matched by name as Spark matches them (without regard to case unless
    `spark.sql.caseSensitive`); a missing column is no problem here (its rows lack a
    field: bad rows, counted)."""
    import json

    kinds = dict(fields)

    def key(name: str) -> str:
        return name if case_sensitive else name.lower()

    wanted = {key(name): name for name in kinds}
    leaves: dict[str, list[Any]] = {}  # top-level field name -> its leaf columns
    for i in range(len(schema)):
        column = schema.column(i)
        leaves.setdefault(column.path.split(".")[0], []).append(column)
    matches: dict[str, list[str]] = {}
    for top in leaves:
        if key(top) in wanted:
            matches.setdefault(wanted[key(top)], []).append(top)
    for name, tops in matches.items():
        if len(tops) > 1:
            return f"more than one column is named {name}"
        (column, *others) = leaves[tops[0]]
        if others or column.path != tops[0]:
            return f"column {name} is nested"
        logical = json.loads(column.logical_type.to_json())
        if not _parquet_type_ok(kinds[name], column.physical_type, logical):
            annotation = logical.get("Type", "None")
            stored = column.physical_type + ("" if annotation == "None" else f" ({annotation})")
            return f"column {name} is {stored}, unreadable as {kinds[name]}"
    return None


# Footers read at once by `check_local_files`: each read waits on the disk (or the
# network mount) for most of its time, with pyarrow's I/O outside the GIL.
FOOTER_READERS = 8


def check_local_files(
    uris: list[str], fields: Mapping[str, str], case_sensitive: bool
) -> tuple[dict[str, SkippedFile], set[str]]:
    """Local Parquet files that cannot be read as receipts (by display path), and the
    valid ones that hold no row. Footers only, with pyarrow, `FOOTER_READERS` at a time
    (tens of thousands of small files from nodes that roll often, on a cold disk or a
    shared mount); ({}, set()) without pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:  # the Spark-side check still catches what fails (module docstring)
        return {}, set()
    known: list[tuple[Any, str | None]] = []  # (schema, problem): nodes write one schema

    def problem_of(schema: Any) -> str | None:
        for seen, problem in known:
            if seen.equals(schema):
                return problem
        problem = parquet_schema_problem(schema, fields, case_sensitive)
        if len(known) < 16:  # a few distinct schemas; never a scan of thousands
            known.append((schema, problem))
        return problem

    def check(uri: str) -> SkippedFile | bool | None:
        """Why the file is skipped, True for a valid file without rows, else None."""
        try:
            meta = pq.read_metadata(uri_path(uri))
        except FileNotFoundError:
            return None  # rolled away since the listing: as `ignoreMissingFiles` has it
        except PermissionError:
            return SkippedFile(uri, "not readable (permission denied): file skipped")
        except Exception:  # pyarrow's ArrowInvalid: not Parquet, or cut short
            return SkippedFile(uri, NOT_PARQUET)
        problem = problem_of(meta.schema)
        if problem:
            return SkippedFile(uri, f"{problem}: file skipped", max(1, meta.num_rows))
        return meta.num_rows == 0

    skipped: dict[str, SkippedFile] = {}
    empty: set[str] = set()
    with ThreadPoolExecutor(FOOTER_READERS, thread_name_prefix="pushgw-footers") as pool:
        for uri, found in zip(uris, pool.map(check, uris), strict=True):
            if isinstance(found, SkippedFile):
                skipped[display_path(uri)] = found
            elif found:
                empty.add(display_path(uri))
    return skipped, empty


def recheck_file(spark: SparkSession, uri: str) -> SkippedFile | None:
    """A listed Parquet file of which Spark read no row: why, through Hadoop (so on any
    file system Spark reads), or None when it is a valid file without rows, or gone."""
    from py4j.protocol import Py4JJavaError

    jvm: Any = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    try:
        # From a java.net.URI: Spark lists files percent-encoded (`sp%20ace`), which
        # Path(String) would take literally, and the file would look gone.
        path = jvm.org.apache.hadoop.fs.Path(jvm.java.net.URI(uri))
        source = jvm.org.apache.parquet.hadoop.util.HadoopInputFile.fromPath(path, conf)
        reader = jvm.org.apache.parquet.hadoop.ParquetFileReader.open(source)
    except Py4JJavaError as exc:
        if exc.java_exception.getClass().getName() == "java.io.FileNotFoundException":
            return None  # rolled away since the listing: as `ignoreMissingFiles` has it
        return SkippedFile(uri, NOT_PARQUET)
    try:
        rows = int(reader.getRecordCount())
    finally:
        reader.close()
    if rows == 0:
        return None
    return SkippedFile(uri, SPARK_FAILED, rows)
