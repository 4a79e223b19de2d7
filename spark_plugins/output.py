"""Writing job outputs to a local directory or any Hadoop file system URI.

Tables are written twice: as a Parquet directory (`NAME.parquet/`, for tools) and as
one CSV file with a header (`NAME.csv`, for people; RFC 4180 quoting; a text value a
spreadsheet would run as a formula starts with `'`, see `FORMULA_START`). A table the job
brings to the driver anyway (`collect=True`: a report's summary, its chart's hours) is
written there, from the rows it collected: one Spark job instead of three, which is most
of a small table's cost. Any other table is written by Spark, as large as it may be.
Small single files (`*.jsonl`, PNG, HTML, JSON, collected tables) are written through
the Hadoop FileSystem API, so `--out hdfs://...` or `s3a://...` works from a cluster
exactly like a local path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from spark_plugins.paths import arg_path, is_local

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from spark_plugins.jobs import JobResult

CSV_OPTIONS = {
    "header": "true",
    "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss'Z'",
    "nullValue": "",
    "escape": '"',  # a quote inside a quoted value is doubled (RFC 4180), not backslashed
    # a value is written as it is: Spark's writer trims spaces, tabs, a CR... by default
    "ignoreLeadingWhiteSpace": "false",
    "ignoreTrailingWhiteSpace": "false",
}
CSV_TIMESTAMP = "%Y-%m-%dT%H:%M:%SZ"  # CSV_OPTIONS' timestampFormat, for rows written here

# A text value that spreadsheets (Excel, LibreOffice, Google Sheets) would evaluate as a
# formula: `=`, `+`, `-` or `@` first, after any leading whitespace, which they skip.
# Receipt fields are untrusted (a provider's reason, a hostile app id), and a formula
# can exfiltrate the sheet (`=HYPERLINK(...)`, `=WEBSERVICE(...)`) or run a command (DDE).
# In CSV such a value starts with a `'` (OWASP's CSV injection advice), which the
# spreadsheet shows as text; the Parquet files hold every value as it is.
FORMULA_START = r"^[ \t\r\n\f\x0B]*[=+\-@]"  # the same pattern in Python and Java
_FORMULA = re.compile(FORMULA_START)


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    jvm: Any = spark.sparkContext._jvm
    jpath = jvm.org.apache.hadoop.fs.Path(path)
    return jpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), jpath


def out_problem(path: str) -> str | None:
    """What keeps a local output directory from being written, or None.

    It must be a directory, or not exist yet: then its nearest existing ancestor must be
    a directory that can be written (`ensure_dir` creates the rest). None for a Hadoop
    URI, which only Spark can look at.
    """
    if not is_local(path):
        return None
    local = os.path.abspath(arg_path(path))
    if os.path.lexists(local) and not os.path.exists(local):
        return f"output path is a broken symbolic link: {path}"
    if os.path.exists(local):
        if not os.path.isdir(local):
            return f"output path exists and is not a directory: {path}"
        if not os.access(local, os.W_OK | os.X_OK):
            return f"output directory is not writable: {path}"
        return None
    parent = os.path.dirname(local)
    while not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"output directory cannot be created: {parent} is not a directory ({path})"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"output directory cannot be created: {parent} is not writable ({path})"
    return None


def ensure_dir(spark: SparkSession, path: str) -> None:
    if is_local(path):
        os.makedirs(arg_path(path), exist_ok=True)
    else:
        fs, jpath = _fs(spark, path)
        fs.mkdirs(jpath)


def write_bytes(spark: SparkSession, path: str, data: bytes) -> str:
    """Write one small file (chart, page, summary) and return its path."""
    if is_local(path):
        local = arg_path(path)
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        tmp = local + ".tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, local)
        except BaseException:
            # A full disk: the half-written file would stay, holding the space it lacked.
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        return local
    fs, jpath = _fs(spark, path)
    stream = fs.create(jpath, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()
    return path


def remove_file(spark: SparkSession, path: str) -> None:
    """Remove the file `path` if it exists: an output an earlier run into the same
    directory wrote and this run does not (it would pass for this run's)."""
    if is_local(path):
        local = arg_path(path)
        if os.path.isfile(local) or os.path.islink(local):
            os.remove(local)
        return
    fs, jpath = _fs(spark, path)
    if fs.isFile(jpath):
        fs.delete(jpath, False)


def strict_json(obj: Any) -> Any:
    """`obj` with every float that JSON has no word for (NaN, Infinity) as None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {key: strict_json(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict_json(value) for value in obj]
    return obj


def write_json(spark: SparkSession, path: str, obj: Any) -> str:
    """Strict JSON (RFC 8259): a NaN or infinite number is written as null."""
    text = json.dumps(strict_json(obj), indent=2, default=str, allow_nan=False)
    return write_bytes(spark, path, (text + "\n").encode())


def replace_dir(spark: SparkSession, path: str) -> None:
    """Remove the directory `path` (if any) and create it empty, as Spark's overwrite does."""
    if is_local(path):
        local = arg_path(path)
        if os.path.isdir(local) and not os.path.islink(local):
            shutil.rmtree(local)
        elif os.path.lexists(local):
            os.remove(local)
        os.makedirs(local)
    else:
        fs, jpath = _fs(spark, path)
        fs.delete(jpath, True)
        fs.mkdirs(jpath)


def write_result(spark: SparkSession, out_dir: str, result: JobResult, started: float) -> JobResult:
    """Finish a job: its run time, and `result-<job>.json` beside its other outputs."""
    result.seconds = time.monotonic() - started
    name = f"result-{result.job}.json"
    result.outputs[name] = write_json(spark, join(out_dir, name), result.as_dict())
    return result


def write_single(
    df: DataFrame, path: str, fmt: str, options: dict[str, str], empty: bytes = b""
) -> str:
    """Write a small DataFrame as exactly one file at `path` (coalesce + rename).

    `empty` is what the file holds when `df` has no rows and Spark writes no part file.
    """
    spark = df.sparkSession
    tmp = path + ".parts"
    df.coalesce(1).write.mode("overwrite").format(fmt).options(**options).save(tmp)
    fs, jtmp = _fs(spark, tmp)
    jvm: Any = spark.sparkContext._jvm
    target = jvm.org.apache.hadoop.fs.Path(path)
    parts = [
        status.getPath()
        for status in fs.listStatus(jtmp)
        if status.getPath().getName().startswith("part-")
    ]
    fs.delete(target, False)
    if parts:
        fs.rename(parts[0], target)
        fs.delete(jtmp, True)
        if is_local(path):  # drop the checksum file of the renamed part, if any
            crc = os.path.join(os.path.dirname(arg_path(path)), f".{os.path.basename(path)}.crc")
            if os.path.exists(crc):
                os.remove(crc)
        return _shown(path)
    fs.delete(jtmp, True)
    return write_bytes(spark, path, empty)


def write_table(
    df: DataFrame, out_dir: str, name: str, sort: list[str], *, collect: bool = False
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """`NAME.parquet/` and `NAME.csv` under `out_dir`, rows sorted by `sort`.

    Returns ({"NAME.parquet": path, "NAME.csv": path}, rows). With `collect`, the table
    is brought to the driver (one Spark job), which writes both files from its rows, and
    the rows are returned as dicts, timestamps as epoch seconds (independent of the
    driver's time zone). Without, Spark writes the files and rows is empty.
    """
    if collect:
        return _write_collected(df, out_dir, name, sort)
    return _write_with_spark(df, out_dir, name, sort), []


def _write_with_spark(df: DataFrame, out_dir: str, name: str, sort: list[str]) -> dict[str, str]:
    """The (small, aggregated) table is computed once with full parallelism and cached
    (unless the caller cached it: then that cache is used and left in place); both files
    are then written from one sorted partition, which needs no range partitioning pass."""
    from pyspark import StorageLevel

    owned = not df.is_cached  # a caller's cache is used as it is, and kept
    cached = df.persist(StorageLevel.MEMORY_AND_DISK) if owned else df
    try:
        single = cached.coalesce(1).sortWithinPartitions(*sort)
        parquet = join(out_dir, f"{name}.parquet")
        single.write.mode("overwrite").parquet(parquet)
        header = (",".join(df.columns) + "\n").encode()
        csv_path = write_single(
            _inert_formulas(single), join(out_dir, f"{name}.csv"), "csv", CSV_OPTIONS, empty=header
        )
    finally:
        if owned:
            cached.unpersist()
    return _table_paths(name, parquet, csv_path)


def _inert_formulas(df: DataFrame) -> DataFrame:
    """`df` with every text value a spreadsheet would run as a formula prefixed with `'`
    (`FORMULA_START`): a projection, so the rows keep their order."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    def inert(name: str) -> Any:
        col = F.col(f"`{name}`")
        return F.when(col.rlike(FORMULA_START), F.concat(F.lit("'"), col)).otherwise(col)

    return df.select(
        *[
            inert(f.name).alias(f.name) if isinstance(f.dataType, StringType) else f"`{f.name}`"
            for f in df.schema.fields
        ]
    )


def _table_paths(name: str, parquet: str, csv_path: str) -> dict[str, str]:
    return {f"{name}.parquet": _shown(parquet), f"{name}.csv": csv_path}


def _shown(path: str) -> str:
    """A written path as reported: a local path without its `file:` scheme."""
    return arg_path(path) if is_local(path) else path


def _write_collected(
    df: DataFrame, out_dir: str, name: str, sort: list[str]
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    spark = df.sparkSession
    table = df.toArrow()  # timestamps come as UTC instants, whatever the session's zone
    rows = table.to_pylist()
    # Spark's order: nulls first, strings by their UTF-8 bytes (= by code point)
    order = sorted(
        range(len(rows)),
        key=lambda i: tuple((rows[i][c] is not None, rows[i][c]) for c in sort),
    )
    table = table.take(pa.array(order, pa.int64()))
    rows = [rows[i] for i in order]

    parquet = join(out_dir, f"{name}.parquet")
    replace_dir(spark, parquet)
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, compression="snappy")
    write_bytes(spark, join(parquet, "part-00000.snappy.parquet"), buffer.getvalue().to_pybytes())
    write_bytes(spark, join(parquet, "_SUCCESS"), b"")
    csv_path = write_bytes(
        spark, join(out_dir, f"{name}.csv"), _csv_bytes(table.column_names, rows)
    )
    plain = [{k: _epoch(v) for k, v in row.items()} for row in rows]
    return _table_paths(name, parquet, csv_path), plain


def _csv_bytes(columns: list[str], rows: list[dict[str, Any]]) -> bytes:
    """Rows as CSV the way CSV_OPTIONS has Spark write them: a header, null as an empty
    field, timestamps as `2025-01-10T16:00:00Z`, booleans as `true`/`false`, NaN and
    infinities as `NaN`, `Inf`, `-Inf`; a value holding a comma, a quote, a CR or an LF
    is quoted (RFC 4180), any other as it is, spaces and tabs included, except text a
    spreadsheet would run as a formula, which starts with `'` (`FORMULA_START`). Unlike
    Spark, an empty string is an empty field too (as Python's csv module writes it)."""
    lines = [_csv_line(columns)]
    lines.extend(_csv_line([_csv_field(row[c]) for c in columns]) for row in rows)
    return "".join(lines).encode()


_CSV_QUOTED = frozenset(',"\r\n')  # what makes a value quoted (RFC 4180)


def _csv_line(fields: list[Any]) -> str:
    """One CSV record and its "\\n". Not Python's csv module: with that line end it leaves
    a value with a bare CR unquoted (Python 3.11), and readers end the record there."""
    texts = ["" if field is None else str(field) for field in fields]
    if texts == [""]:
        return '""\n'  # as the csv module: one empty field, not a blank line readers skip
    return ",".join(_csv_quote(text) for text in texts) + "\n"


def _csv_quote(text: str) -> str:
    if _CSV_QUOTED.isdisjoint(text):
        return text
    return '"' + text.replace('"', '""') + '"'


def _csv_field(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.strftime(CSV_TIMESTAMP)  # a UTC instant (toArrow)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):  # Spark's nanValue, ...Inf
        return "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
    if isinstance(value, str) and _FORMULA.match(value):
        return "'" + value  # as `_inert_formulas` has Spark write it
    return value  # None is written as an empty field


def _epoch(value: Any) -> Any:
    return int(value.timestamp()) if isinstance(value, datetime) else value
