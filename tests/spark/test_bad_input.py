"""Bad input is counted and reported, never fatal: implausible values (too small and
too large), Parquet files Spark cannot read, JSON arrays on a line; and the end of the
dead-token window.

Receipts come from the gateway's `ReceiptWriter` (`synthetic.write_with_receipt_writer`);
lines no writer produces are the writer's own records, edited."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gateway.core.push import Outcome, Receipt
from gateway.core.receipts import receipt_record
from spark_plugins import (
    dead_tokens,
    delivery_report,
    output,
    parquet_files,
    synthetic,
    volume_anomalies,
)
from spark_plugins.reader import read_receipts, report_bad_input
from tests.spark import reference
from tests.spark.conftest import START, receipt

pytestmark = pytest.mark.spark

H = 3600.0


def _strict_json(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as RFC 8259 and most parsers do."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _record_line(item: Receipt, **changes: Any) -> str:
    """The writer's record for `item` as a JSON line, with some fields changed."""
    return json.dumps({**receipt_record(item), **changes}, separators=(",", ":"))


def _implausible(*, nan: bool = True) -> list[Receipt]:
    """Receipts the writer writes as they come, each with one value no job can use
    (NaN only in JSON Lines: Arrow's JSON parser, which makes the Parquet files, refuses
    it and the file stays JSON Lines)."""
    items = [
        receipt(1e20, Outcome.OK, token="a"),  # overflows a timestamp
        receipt(START * 1e6, Outcome.OK, token="a"),  # microseconds
        receipt(START * 1e3, Outcome.OK, token="a"),  # milliseconds
        receipt(0.0, Outcome.OK, token="a"),  # a clock never set
        receipt(START, Outcome.OK, token="a", latency=-0.001),
        receipt(START, Outcome.OK, token="a", attempts=-1),
    ]
    if nan:
        items += [
            receipt(float("nan"), Outcome.OK, token="a"),  # written as NaN
            receipt(START, Outcome.OK, token="a", latency=float("nan")),
        ]
    return items


def test_implausible_values_are_bad_lines_not_failures(spark: Any, tmp_path: Path) -> None:
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(120, seed=11)), receipts)
    synthetic.write_with_receipt_writer(_implausible(), receipts / "node-b")
    synthetic.write_with_receipt_writer(
        _implausible(nan=False), receipts / "node-c", file_format="parquet"
    )
    model = receipt(START, Outcome.OK, token="a")
    strings = receipts / "strings.jsonl"
    strings.write_text(_record_line(model, ts="NaN") + "\n" + _record_line(model, ts="Infinity"))
    (written,) = (receipts / "node-b").glob("*.jsonl")
    (parquet,) = (receipts / "node-c").glob("*.parquet")

    for job, given in (
        (delivery_report.JOB, {"chart": "false"}),
        (volume_anomalies.JOB, {"by": "plugin,provider"}),
    ):
        result = job.run(spark, str(receipts), str(tmp_path / job.name), job.resolve_options(given))
        stats = result.input
        assert (stats.records, stats.bad) == (120, 8 + 2 + 6), job.name
        located = {(b.file, b.line) for b in stats.bad_lines if b.line is not None}
        assert located == {(str(written), n) for n in range(1, 9)} | {
            (str(strings), 1),
            (str(strings), 2),
        }
        (rows,) = [b for b in stats.bad_lines if b.line is None]
        assert rows.file == str(parquet)
        for words in (
            "ts is not a unix time in seconds from 2000 to 2099",
            "latency_ms is negative or not finite",
            "attempts is negative",
        ):
            assert words in rows.text
    hours = (tmp_path / "volume-anomalies" / "volume.csv").read_text().splitlines()[1:]
    assert {line[:4] for line in hours} == {"2025"}  # no series from 1970 or the year 5e4


def _hourly(path: str) -> dict[int, dict[str, Any]]:
    """The report's hourly table by hour (epoch seconds)."""
    return {int(r["hour"].timestamp()): r for r in pq.read_table(path).to_pylist()}


def _run_with_upper_bounds(
    spark: Any, tmp_path: Path, lines: list[str], parquet: list[Receipt]
) -> tuple[Any, Path, Path]:
    """delivery-report (chart included) over 120 writer receipts, `lines` in a JSON Lines
    file of their own, `parquet` written by the writer as Parquet: (result, lines' file,
    Parquet file)."""
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(120, seed=15)), receipts)
    bounds = receipts / "node-b" / "bounds.jsonl"
    bounds.parent.mkdir()
    bounds.write_text("".join(line + "\n" for line in lines))
    synthetic.write_with_receipt_writer(parquet, receipts / "node-c", file_format="parquet")
    (written,) = (receipts / "node-c").glob("*.parquet")
    options = delivery_report.JOB.resolve_options({})
    result = delivery_report.JOB.run(spark, str(receipts), str(tmp_path / "out"), options)
    # the report's numbers are those of the good receipts (JSON Lines: all but Parquet's)
    records = reference.load(receipts)
    good = [r for r in records if reference.plausible(r)]
    assert len(records) - len(good) == result.input.bad - len(parquet)
    hourly = _hourly(result.outputs["hourly.parquet"])
    for hour, want in reference.delivery_hourly(good).items():
        for name in ("total", "ok", "attempts", "retries", "retried", "latency_max"):
            assert hourly[hour][name] == want[name], name
        assert hourly[hour]["latency_mean"] == pytest.approx(want["latency_mean"], rel=1e-9)
    assert Path(result.outputs["chart.png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result, bounds, written


def test_attempts_and_http_status_above_their_bounds_are_bad_lines(
    spark: Any, tmp_path: Path
) -> None:
    """Two receipts of 2**62 + 1 attempts in one group overflowed the report's sum (the
    job died with [ARITHMETIC_OVERFLOW]), and `http_status` had no upper bound: above
    2147483647 and 999 they are bad lines; the bounds themselves are good."""
    model = receipt(START, Outcome.OK, token="a")
    lines = [
        _record_line(model, attempts=2**62 + 1),
        _record_line(model, attempts=2**62 + 1),  # the same group: the sum overflowed
        _record_line(model, attempts=2**31),
        _record_line(model, http_status=1000),
        _record_line(model, http_status=10**15),
        _record_line(model, attempts=2**31 - 1),  # good from here on
        _record_line(model, http_status=999),
        _record_line(model, http_status=0),
    ]
    parquet = [
        dataclasses.replace(model, attempts=2**62 + 1),
        dataclasses.replace(model, attempts=2**62 + 1),
        dataclasses.replace(model, status=1000),
    ]
    result, bounds, written = _run_with_upper_bounds(spark, tmp_path, lines, parquet)
    stats = result.input
    assert (stats.records, stats.bad) == (120 + 3, 5 + 3)
    located = {(b.file, b.line) for b in stats.bad_lines if b.line is not None}
    assert located == {(str(bounds), n) for n in range(1, 6)}
    (rows,) = [b for b in stats.bad_lines if b.line is None]
    assert rows.file == str(written)
    assert rows.text == "(rows skipped: attempts is above 2147483647; http_status is above 999)"


def test_latency_above_30_days_is_a_bad_line_not_a_broken_report(
    spark: Any, tmp_path: Path
) -> None:
    """A latency of 1.7e308 ms (finite) overflowed the sum (a mean of Infinity) and
    broke the chart, failing the job: above 30 days it is a bad line; 30 days is good."""
    model = receipt(START, Outcome.OK, token="a")
    lines = [
        _record_line(model, latency_ms=1.7e308),
        _record_line(model, latency_ms=1.7e308),
        _record_line(model, latency_ms=2_592_000_000.001),
        _record_line(model, latency_ms=2_592_000_000.0),  # good
    ]
    parquet = [dataclasses.replace(model, latency=1.7e305)]  # seconds: 1.7e308 ms
    result, bounds, written = _run_with_upper_bounds(spark, tmp_path, lines, parquet)
    stats = result.input
    assert (stats.records, stats.bad) == (120 + 1, 3 + 1)
    located = {(b.file, b.line) for b in stats.bad_lines if b.line is not None}
    assert located == {(str(bounds), n) for n in range(1, 4)}
    (rows,) = [b for b in stats.bad_lines if b.line is None]
    assert rows.file == str(written)
    assert rows.text == "(rows skipped: latency_ms is above 2592000000 (30 days))"
    hourly = _hourly(result.outputs["hourly.parquet"])
    assert hourly[int(START)]["latency_max"] == 2_592_000_000.0
    assert all(math.isfinite(r["latency_mean"]) for r in hourly.values())


def _writer_parquet(directory: Path, n: int, seed: int) -> Path:
    synthetic.write_with_receipt_writer(
        list(synthetic.receipts(n, seed=seed)), directory, file_format="parquet"
    )
    (path,) = directory.glob("*.parquet")
    return path


def _replace(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    index = table.schema.get_field_index(name)
    return table.set_column(index, pa.field(name, values.type), values)


def test_parquet_files_spark_cannot_read_are_skipped_and_reported(
    spark: Any, tmp_path: Path
) -> None:
    receipts = tmp_path / "receipts"
    good = _writer_parquet(receipts / "good", 60, seed=12)
    table = pq.read_table(good).slice(0, 10)
    odd = receipts / "odd"
    odd.mkdir()
    pq.write_table(_replace(table, "ts", table["ts"].cast(pa.string())), odd / "ts-string.parquet")
    pq.write_table(_replace(table, "reason", pa.nulls(10)), odd / "null-reason.parquet")
    data = good.read_bytes()
    (odd / "truncated.parquet").write_bytes(data[: len(data) // 2])
    (odd / "zero-bytes.parquet").write_bytes(b"")
    pq.write_table(table.slice(0, 0), odd / "no-rows.parquet")
    narrow = table
    for name, kind in (("v", pa.int32()), ("attempts", pa.int32()), ("latency_ms", pa.float32())):
        narrow = _replace(narrow, name, narrow[name].cast(kind))
    pq.write_table(narrow, odd / "narrow-types.parquet")  # compatible: read

    source = read_receipts(spark, str(receipts))
    assert source.df.count() == 70  # `reason` is not read here: its file is left out anyway
    stats = source.stats()
    assert stats.files == 7
    assert (stats.records, stats.bad) == (70, 10 + 10 + 1 + 1)
    texts = {Path(b.file).name: b.text for b in stats.bad_lines}
    assert texts == {
        "ts-string.parquet": "(column ts is BYTE_ARRAY (String), unreadable as DOUBLE: "
        "file skipped)",
        "null-reason.parquet": "(column reason is INT32 (Null), unreadable as STRING: "
        "file skipped)",
        "truncated.parquet": f"({parquet_files.NOT_PARQUET})",
        "zero-bytes.parquet": f"({parquet_files.NOT_PARQUET})",
    }
    assert stats.bad_files == sorted(str(odd / name) for name in texts)
    assert stats.listed_all  # 22 rows skipped, in 4 entries: nothing left unlisted
    told = io.StringIO()
    report_bad_input(stats, told)
    assert "and more" not in told.getvalue()

    # every job runs, and sees the same input
    result = dead_tokens.JOB.run(
        spark, str(receipts), str(tmp_path / "out"), dead_tokens.JOB.resolve_options({})
    )
    assert result.input.as_dict() == stats.as_dict()


def test_a_cut_listing_says_so_and_a_whole_one_does_not(spark: Any, tmp_path: Path) -> None:
    """A Parquet file's entry stands for every row skipped in it: the listing was said
    to have "... and N more" when it held everything, and a cut one is said to be cut."""
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(_implausible(), receipts)
    foreign = receipts / "foreign.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), foreign)  # another tool's file: 3 rows
    for most, whole in ((100, True), (9, True), (8, False), (0, False)):
        source = read_receipts(spark, str(receipts), max_reported=most)
        source.df.count()  # the pass the counts are observed on
        stats = source.stats()
        assert stats.bad == 8 + 3
        assert stats.listed_all is whole, most
        told = io.StringIO()
        report_bad_input(stats, told)
        cut = f"... and more: {min(most, 9)} listed (option max_bad_lines)"
        assert (cut in told.getvalue()) is not whole, told.getvalue()


def test_spark_side_check_reports_files_no_footer_check_saw(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On HDFS or S3 (or without pyarrow) no footer is read before the job: Spark skips
    what it cannot read, and the files that gave no row are looked at afterwards."""
    no_check = lambda uris, fields, case_sensitive: ({}, set())  # noqa: E731
    monkeypatch.setattr(parquet_files, "check_local_files", no_check)
    receipts = tmp_path / "receipts"
    good = _writer_parquet(receipts / "good", 40, seed=13)
    table = pq.read_table(good).slice(0, 10)
    pq.write_table(_replace(table, "ts", table["ts"].cast(pa.string())), receipts / "ts.parquet")
    data = good.read_bytes()
    (receipts / "truncated.parquet").write_bytes(data[: len(data) // 2])
    pq.write_table(table.slice(0, 0), receipts / "no-rows.parquet")
    shutil.copy(good, receipts / "copy.parquet")

    source = read_receipts(spark, str(receipts))
    assert source.df.agg({"latency_ms": "sum", "reason": "count"}).count() == 1
    stats = source.stats()
    assert (stats.records, stats.bad) == (80, 10 + 1)
    texts = {Path(b.file).name: b.text for b in stats.bad_lines}
    assert texts == {
        "ts.parquet": f"({parquet_files.SPARK_FAILED})",
        "truncated.parquet": f"({parquet_files.NOT_PARQUET})",
    }


# (column, values, whether Spark 4 reads it as the receipt's type)
TYPES = [
    ("ts", pa.array([1.0], pa.float32()), True),
    ("ts", pa.array([1], pa.int32()), True),
    ("ts", pa.array([1], pa.int16()), True),
    ("ts", pa.array([1], pa.int64()), False),
    ("ts", pa.array([1], pa.timestamp("s")), False),
    ("attempts", pa.array([1], pa.int8()), True),
    ("attempts", pa.array([1], pa.uint32()), True),
    ("attempts", pa.array([1], pa.uint64()), False),
    ("attempts", pa.array([1.0], pa.float64()), False),
    ("http_status", pa.array([1], pa.decimal128(10, 0)), False),
    ("push_id", pa.array([b"x"], pa.binary()), True),
    ("push_id", pa.array(["x"], pa.large_string()), True),
    ("push_id", pa.array(["x"]).dictionary_encode(), True),
    ("push_id", pa.array([b"x"], pa.binary(1)), False),
    ("push_id", pa.array([1], pa.int64()), False),
    ("latency_ms", pa.array([[1.0]]), False),
]


def test_parquet_type_rules_match_what_spark_reads(spark: Any, tmp_path: Path) -> None:
    """`parquet_schema_problem` says a file is unreadable exactly when Spark cannot read it."""
    from spark_plugins.parquet_files import parquet_schema_problem
    from spark_plugins.reader import RECEIPT_DDL, RECEIPT_FIELDS

    base = pa.Table.from_pylist([receipt_record(receipt(START, Outcome.OK, token="t"))])
    base = _replace(base, "reason", pa.array(["x"]))  # not the null type of a None
    cases = [(name, values) for name, values, _ in TYPES]
    cases.append(("TS", pa.array(["x"])))  # Spark matches names without regard to case
    cases.append(("TS", pa.array([1.0])))
    for i, (name, values) in enumerate(cases):
        table = _replace(base, name, values) if name in base.column_names else base
        if name not in base.column_names:
            table = table.drop_columns(["ts"]).append_column(name, values)
        path = tmp_path / f"case-{i}.parquet"
        pq.write_table(table, path)
        verdict = parquet_schema_problem(pq.read_metadata(path).schema, dict(RECEIPT_FIELDS))
        try:
            spark.read.schema(RECEIPT_DDL).parquet(str(path)).collect()
            reads = True
        except Exception:
            reads = False
        assert (verdict is None) == reads, (name, values.type, verdict)
    assert [reads for _, _, reads in TYPES] == [
        parquet_schema_problem(
            pq.read_metadata(tmp_path / f"case-{i}.parquet").schema, dict(RECEIPT_FIELDS)
        )
        is None
        for i in range(len(TYPES))
    ]


def test_json_arrays_are_counted_and_listed_alike(spark: Any, tmp_path: Path) -> None:
    """A JSON array on a line is read as its elements (Spark's JSON source): counted as
    receipts, and listed when one of them is bad, so the count and the list agree."""
    receipts = tmp_path / "receipts"
    items = list(synthetic.receipts(20, seed=14))
    synthetic.write_with_receipt_writer(items, receipts)
    (path,) = receipts.glob("*.jsonl")
    one, two = _record_line(items[0]), _record_line(items[1])
    extra = {
        21: f"[{one},{two}]",  # two receipts
        22: "[]",  # none: ignored, like an empty line
        23: "[" + _record_line(items[2], v=2) + "]",  # bad
        24: f"[{one},42]",  # bad: not an object
        25: "[" + _record_line(items[3], http_status="abc") + "]",  # bad: wrong type
        26: _record_line(items[4], push_id=123),  # read as "123" (documented)
        27: "\t ",  # empty
        28: _record_line(items[5], ts=START + 1) + " trailing",  # the object is read
        29: _record_line(items[6], http_status="abc"),  # bad, even for a job not using it
    }
    with path.open("a") as fh:
        for line_no in sorted(extra):
            fh.write(extra[line_no] + "\n")
    source = read_receipts(spark, str(receipts))
    assert source.df.filter("push_id = '123'").count() == 1
    stats = source.stats()
    assert (stats.records, stats.bad) == (20 + 2 + 1 + 1, 4)
    located = [(b.file, b.line) for b in stats.bad_lines]
    assert located == [(str(path), n) for n in (23, 24, 25, 29)]


def test_dead_token_window_ends_no_later_than_now(spark: Any, tmp_path: Path) -> None:
    """One receipt from a clock running 30 days ahead moves no window; `now` bounds the
    streak rule only; `ok` wins a tie; the result file is strict JSON."""
    wall = float(int(time.time()))
    transient = [
        receipt(wall - h * H, Outcome.TRANSIENT, token=token, reason="UNAVAILABLE")
        for token in ("streak", "ok-after-now")
        for h in (100, 80, 60, 40, 20)
    ]
    items = [
        *transient,
        receipt(wall + 30 * 24 * H, Outcome.OK, token="skewed-clock"),
        receipt(wall + 48 * H, Outcome.OK, token="ok-after-now"),
        receipt(wall - 50 * H, Outcome.OK, token="perm-after-now"),
        receipt(
            wall + 24 * H, Outcome.TOKEN_INVALID, token="perm-after-now", reason="Unregistered"
        ),
        receipt(wall - 50 * H, Outcome.TOKEN_INVALID, token="tie", reason="BadDeviceToken"),
        receipt(wall - 50 * H, Outcome.OK, token="tie"),
    ]
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts)
    nan = _record_line(receipt(wall, Outcome.OK, token="nan"), ts="NaN")
    (receipts / "nan.jsonl").write_text(nan + "\n")
    out = tmp_path / "out"

    before = time.time()
    result = dead_tokens.JOB.run(
        spark, str(receipts), str(out), dead_tokens.JOB.resolve_options({})
    )
    after = time.time()

    assert (result.input.records, result.input.bad) == (len(items), 1)
    assert before <= result.metrics["window_end"] <= after
    entries = [json.loads(line) for line in (out / "dead-tokens.jsonl").read_text().splitlines()]
    retired = {e["token_hash"]: e["reason"] for e in entries}
    assert retired == {
        synthetic.token_hash("streak"): dead_tokens.STREAK_REASON,
        synthetic.token_hash("perm-after-now"): "Unregistered",
    }
    saved = _strict_json((out / "result-dead-tokens.json").read_text())
    assert saved["metrics"]["window_end"] == result.metrics["window_end"]


def test_default_window_end_and_strict_result_json() -> None:
    assert dead_tokens.default_window_end(None, 5.0) == 5.0
    assert dead_tokens.default_window_end(3.0, 5.0) == 3.0
    assert dead_tokens.default_window_end(9.0, 5.0) == 5.0
    nan, inf = float("nan"), float("inf")
    assert output.strict_json({"a": nan, "b": [inf, 1.5, {"c": -inf}], "d": (2,)}) == {
        "a": None,
        "b": [None, 1.5, {"c": None}],
        "d": [2],
    }
