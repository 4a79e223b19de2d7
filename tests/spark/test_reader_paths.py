"""A receipts directory is read as the directory it names, even when its name holds
characters Hadoop's glob expands (`[1]`, `{a,b}`, `*`, `?`, `\\`); bad lines are shown
under the real path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.core.push import Outcome
from gateway.core.receipts import receipt_record
from spark_plugins import delivery_report, parquet_files, synthetic
from spark_plugins.reader import literal_path, read_receipts
from tests.spark.conftest import START, receipt


def test_literal_path_escapes_hadoops_glob_characters() -> None:
    assert literal_path("/data/receipts") == "/data/receipts"
    assert literal_path("file:///data/r[1]") == "file:///data/r\\[1\\]"
    assert literal_path("s3a://bucket/a{b,c}/*?") == "s3a://bucket/a\\{b,c\\}/\\*\\?"
    assert literal_path("hdfs://nn:8020/x\\y z%20") == "hdfs://nn:8020/x\\\\y z%20"


def _receipts(directory: Path, seed: int) -> tuple[Path, Path]:
    """30 writer receipts (JSON Lines in a subdirectory with a glob-like name, Parquet),
    one bad line and one truncated Parquet file: (the bad line's file, the Parquet one)."""
    synthetic.write_with_receipt_writer(list(synthetic.receipts(20, seed=seed)), directory / "s[2]")
    synthetic.write_with_receipt_writer(
        list(synthetic.receipts(10, seed=seed)), directory, file_format="parquet"
    )
    bad = directory / "s[2]" / "x{y}.jsonl"
    record = receipt_record(receipt(START, Outcome.OK, token="a"))
    bad.write_text(json.dumps({**record, "attempts": -1}) + "\n")
    (good,) = directory.glob("*.parquet")
    data = good.read_bytes()
    truncated = directory / "t[1].parquet"
    truncated.write_bytes(data[: len(data) // 2])
    return bad, truncated


NAMES = ["r[1]", "a{b,c}", "s*t", "q?", "back\\slash", "plain"]


@pytest.mark.spark
def test_a_directory_named_like_a_glob_is_read_as_it_is(spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "G"
    # what the glob `r[1]` (and `s*t`, `q?`) would match instead: never read
    synthetic.write_with_receipt_writer(list(synthetic.receipts(7, seed=30)), root / "r1")
    synthetic.write_with_receipt_writer(list(synthetic.receipts(7, seed=31)), root / "sxt")
    synthetic.write_with_receipt_writer(list(synthetic.receipts(7, seed=32)), root / "qx")
    for i, name in enumerate(NAMES):
        directory = root / name
        bad, truncated = _receipts(directory, seed=40 + i)
        # a `file:` URI takes `?` for the start of a query (a plain path does not)
        given = [str(directory)] + ([] if "?" in name else [f"file://{directory}"])
        for path in given:
            source = read_receipts(spark, path)
            assert source.df.count() == 30, path
            stats = source.stats()
            assert (stats.records, stats.bad, stats.files) == (30, 1 + 1, 4), path
            lines = [(b.file, b.line) for b in stats.bad_lines]
            assert lines == [(str(bad), 1), (str(truncated), None)], path
            assert stats.bad_files == sorted([str(bad), str(truncated)]), path

    # the job as reported: `pushgw spark run delivery-report --receipts G/r[1]`
    options = delivery_report.JOB.resolve_options({"chart": "false"})
    result = delivery_report.JOB.run(spark, str(root / "r[1]"), str(tmp_path / "out"), options)
    assert (result.input.records, result.input.bad) == (30, 2)
    assert result.metrics["receipts"] == 30


def _no_footer_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on HDFS or S3 (or without pyarrow): Spark lists and reads the Parquet files."""
    no_check = lambda uris, fields, case_sensitive: ({}, set())  # noqa: E731
    monkeypatch.setattr(parquet_files, "check_local_files", no_check)


@pytest.mark.spark
def test_spark_side_check_reads_a_glob_like_directory(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_footer_check(monkeypatch)
    bad, _ = _receipts(tmp_path / "r[1]", seed=50)
    source = read_receipts(spark, str(tmp_path / "r[1]"))
    assert source.df.count() == 30
    stats = source.stats()
    assert stats.records == 30
    assert [(b.file, b.line) for b in stats.bad_lines if b.line is not None] == [(str(bad), 1)]


@pytest.mark.spark
def test_spark_side_check_reports_a_bad_file_in_a_directory_spark_encodes(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_footer_check(monkeypatch)
    for name in ("sp ace", "r[1]"):
        _, truncated = _receipts(tmp_path / name, seed=51)
        source = read_receipts(spark, str(tmp_path / name))
        assert source.df.count() == 30, name
        stats = source.stats()
        assert (stats.records, stats.bad) == (30, 2), name
        assert (str(truncated), None) in [(b.file, b.line) for b in stats.bad_lines], name
