"""Review of the Spark jobs over a fleet that rolls receipts often (seat: small files).

Nodes with small `receipts.roll_*` settings leave thousands of small files in deep date
directories, some empty or without rows, while the gateway keeps publishing files during
a job. The reader must list such a tree cheaply (no Spark job per directory, one
listing per source, footers read several at a time), read each file once, locate a bad
line without reading every file again, and keep the numbers exact for an app that has
nearly all of the traffic. Scaling is shown by counting listings, jobs and tasks, never
by timing.

The files are written as the gateway writes them: each receipt serialised by the
writer's own `record_line(receipt_record(...))`, Parquet files converted by the writer's
own `receipts_parquet.convert`, a crashed node's file published by the writer's
`finish`, and named `receipts-<start>-<pid>-<seq>.jsonl` like the writer's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from gateway.core import receipts_parquet
from gateway.core.push import ProviderKind, Receipt
from gateway.core.receipts import finish, receipt_record, record_line
from gateway.receipt_files import read_records
from spark_plugins import delivery_report, parquet_files, synthetic
from spark_plugins.reader import RECEIPT_FIELDS, read_receipts
from tests.spark import reference
from tests.spark.conftest import START

pytestmark = pytest.mark.spark


def _write_file(path: Path, items: list[Receipt], *, parquet: bool = False) -> Path:
    """One published receipts file of `items`, as the writer publishes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    jsonl = path.with_suffix(".jsonl")
    jsonl.write_text("".join(record_line(receipt_record(r)) for r in items))
    if not parquet:
        return jsonl
    target = path.with_suffix(".parquet")
    receipts_parquet.convert(jsonl, target)
    jsonl.unlink()
    return target


def _fleet(root: Path, items: list[Receipt], files: int, *, parquet_every: int = 4) -> None:
    """`items` spread over `files` small files of 4 nodes in `node/YYYY/MM/DD`
    directories; every `parquet_every`-th file Parquet."""
    per = max(1, len(items) // files)
    for i in range(files):
        chunk = items[i * per : (i + 1) * per] if i < files - 1 else items[i * per :]
        day = root / f"node-{i % 4}" / "2025" / f"{1 + i % 3:02d}" / f"{1 + (i // 3) % 28:02d}"
        name = day / f"receipts-20250101T{i % 24:02d}0000Z-{100 + i % 4}-{i:05d}"
        _write_file(name, chunk, parquet=bool(parquet_every) and i % parquet_every == 0)


def _hive_metric(spark: Any, name: str) -> int:
    """One of Spark's file-listing counters (`HiveCatalogMetrics`, what Spark's own
    tests count listings with)."""
    metrics = spark.sparkContext._jvm.org.apache.spark.metrics.source.HiveCatalogMetrics
    return int(getattr(metrics, name)().getCount())


@contextmanager
def _job_group(spark: Any, group: str) -> Iterator[list[int]]:
    """The Spark jobs this thread runs inside, as ids (filled on exit)."""
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    ids: list[int] = []
    try:
        yield ids
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        ids += sc.statusTracker().getJobIdsForGroup(group)


def _tasks(spark: Any, job_ids: list[int]) -> int:
    tracker = spark.sparkContext.statusTracker()
    total = 0
    for job in job_ids:
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info else []:
            stage_info = tracker.getStageInfo(stage)
            total += stage_info.numTasks if stage_info else 0
    return total


def test_a_local_tree_of_many_day_directories_is_listed_without_a_spark_job(
    spark: Any, tmp_path: Path
) -> None:
    """A node keeping one directory per day has more than 32 of them within a month.
    Spark lists a directory of more than 32 subdirectories with a Spark job of one task
    per subdirectory, once per source: for a local tree that cost 4-7x the driver's own
    listing. Making the receipts' DataFrame must run no Spark job at all."""
    items = list(synthetic.receipts(80, seed=11, start=START, hours=2))
    for day in range(40):
        _write_file(
            tmp_path / "node-a" / f"2025-01-{day + 1:02d}" / f"receipts-x-1-{day}",
            items[2 * day : 2 * day + 2],
            parquet=day % 2 == 0,
        )
    before = _hive_metric(spark, "METRIC_PARALLEL_LISTING_JOB_COUNT")
    with _job_group(spark, "small-files-listing") as jobs:
        source = read_receipts(spark, str(tmp_path))
    assert _hive_metric(spark, "METRIC_PARALLEL_LISTING_JOB_COUNT") == before
    assert jobs == []
    assert source.df.count() == 80
    assert source.stats().files == 40 and source.stats().bad == 0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,200 files of 2 receipts (a quarter Parquet) in deep date directories, plus a
    file of a crashed node holding only a cut-short line (published by the writer as a
    Parquet file without rows) and an empty `.jsonl` (copied in by hand)."""
    root = tmp_path_factory.mktemp("fleet")
    items = list(synthetic.receipts(2400, seed=12, start=START, hours=24, tokens=200))
    _fleet(root, items, 1200)
    crashed = root / "node-0" / "2025" / "01" / "01" / "receipts-20250101T000000Z-9-1.jsonl.open"
    crashed.write_text(record_line(receipt_record(items[0]))[:40])
    assert finish(crashed, "parquet") == "parquet"
    assert pq.read_metadata(crashed.with_suffix("").with_suffix(".parquet")).num_rows == 0
    (root / "node-0" / "2025" / "01" / "01" / "receipts-20250101T000000Z-9-2.jsonl").touch()
    return root


def test_the_tree_is_listed_once_per_format_and_read_in_few_tasks(spark: Any, fleet: Path) -> None:
    """The JSON Lines and the Parquet source must each list the tree once; the text
    source used only to number bad lines was listed a third time on every run, bad
    lines or not: a third more listing of tens of thousands of files for each job."""
    on_disk = sum(1 for p in fleet.rglob("*") if p.is_file())
    before = _hive_metric(spark, "METRIC_FILES_DISCOVERED")
    source = read_receipts(spark, str(fleet))
    discovered = _hive_metric(spark, "METRIC_FILES_DISCOVERED") - before
    assert discovered <= 2 * on_disk, (discovered, on_disk)
    # Spark packs small files into a task (`openCostInBytes`): never a task per file
    assert source.df.rdd.getNumPartitions() <= on_disk // 10
    assert source.df.count() == len(read_records(fleet)) == 2400
    stats = source.stats()
    assert (stats.files, stats.bad, stats.bad_lines) == (on_disk, 0, [])


def test_locating_a_bad_line_reads_only_its_file(spark: Any, fleet: Path, tmp_path: Path) -> None:
    """The second pass that numbers bad lines is documented to read the affected files
    only; its filter on the file came after `monotonically_increasing_id()`, which Spark
    does not push a filter through, so one bad line made every job read every JSON
    Lines file again (more tasks than the counting pass itself)."""
    bad = fleet / "node-0" / "2025" / "01" / "01" / "receipts-20250101T000000Z-7-1.jsonl"
    good = record_line(receipt_record(next(synthetic.receipts(1, seed=13, start=START))))
    bad.write_text(good + '{"v": 1, "ts": 17357\n' + good)
    try:
        source = read_receipts(spark, str(fleet))
        counting_tasks = source.df.rdd.getNumPartitions()
        assert source.df.count() == 2402
        with _job_group(spark, "small-files-locate") as jobs:
            stats = source.stats()
    finally:
        bad.unlink()
    assert stats.bad == 1
    assert [(b.file, b.line) for b in stats.bad_lines] == [(str(bad), 2)]
    assert 0 < _tasks(spark, jobs) < counting_tasks, (_tasks(spark, jobs), counting_tasks)


def test_a_file_published_while_the_job_lists_is_counted_and_located(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node publishes a file (its crashed `.jsonl.open`, last line cut short) while a
    job starts. The files the job reports, the receipts it counts and the bad lines it
    lists must come from one listing: the text source was listed before the JSON one,
    so the new file's receipts were counted while the file was not, and its bad line
    was counted but never listed, with `listed_all` still true."""
    from pyspark.sql.readwriter import DataFrameReader

    items = list(synthetic.receipts(40, seed=14, start=START, hours=2))
    _fleet(tmp_path, items, 10, parquet_every=0)
    late = tmp_path / "node-3" / "2025" / "01" / "09" / "receipts-20250101T090000Z-5-1.jsonl.open"
    late.parent.mkdir(parents=True, exist_ok=True)
    late.write_text("".join(record_line(receipt_record(r)) for r in items[:2]) + '{"v": 1, "t')
    real_json = DataFrameReader.json

    def publish_then_list(self: Any, *args: Any, **kwargs: Any) -> Any:
        if late.exists():
            assert finish(late, "jsonl") == "jsonl"  # as the node's writer publishes it
        return real_json(self, *args, **kwargs)

    monkeypatch.setattr(DataFrameReader, "json", publish_then_list)
    source = read_receipts(spark, str(tmp_path))
    assert source.df.count() == 42
    stats = source.stats()
    published = late.with_suffix("")
    assert stats.files == 11
    assert stats.records == 42 and stats.bad == 1
    assert [(b.file, b.line) for b in stats.bad_lines] == [(str(published), 3)]
    assert stats.listed_all


def test_parquet_footers_are_read_several_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver reads every local Parquet file's footer before a job. Each read waits
    on the disk or a shared mount; tens of thousands of them one after the other is
    minutes on a cold disk. Two reads must be under way at once: the first two meet at
    a barrier, which a serial loop never reaches (it breaks, and the file looks bad)."""
    items = list(synthetic.receipts(12, seed=15, start=START))
    uris = []
    for i in range(4):
        path = _write_file(tmp_path / f"receipts-x-1-{i}", items[3 * i : 3 * i + 3], parquet=True)
        uris.append(path.as_uri())
    empty = tmp_path / "receipts-x-1-9.jsonl.open"
    empty.write_text('{"cut')
    assert finish(empty, "parquet") == "parquet"
    uris.append(empty.with_suffix("").with_suffix(".parquet").as_uri())

    barrier = threading.Barrier(2, timeout=20)
    calls = iter(range(len(uris)))
    lock = threading.Lock()
    real = pq.read_metadata

    def read_metadata(*args: Any, **kwargs: Any) -> Any:
        with lock:
            call = next(calls)
        if call < 2:
            barrier.wait()  # both first reads in flight together
        return real(*args, **kwargs)

    monkeypatch.setattr(pq, "read_metadata", read_metadata)
    skipped, empties = parquet_files.check_local_files(uris, dict(RECEIPT_FIELDS), False)
    assert skipped == {}
    assert empties == {str(empty.with_suffix("").with_suffix(".parquet"))}


def test_a_skewed_app_in_many_small_files_matches_the_reference(spark: Any, tmp_path: Path) -> None:
    """One app with 99% of the traffic, in 300 small files with empty ones among them:
    every summary number (exact percentiles) equals the plain-Python reference."""
    items = list(synthetic.receipts(1500, seed=16, start=START, hours=6, tokens=50))
    skewed = [
        r
        if i % 100 == 0
        else dataclasses.replace(
            r, plugin="matrix", app_id="im.vector.app.ios", provider=ProviderKind.APNS
        )
        for i, r in enumerate(items)
    ]
    receipts = tmp_path / "receipts"
    _fleet(receipts, skewed, 300)
    for i in range(5):  # crashed nodes' files of one cut line: Parquet without rows
        crashed = receipts / f"node-{i % 4}" / f"receipts-20250101T000000Z-8-{i}.jsonl.open"
        crashed.write_text('{"v": 1')
        finish(crashed, "parquet")
    (receipts / "node-0" / "receipts-20250101T000000Z-8-9.jsonl").touch()
    records = read_records(receipts)
    options = delivery_report.JOB.resolve_options({"percentiles": "exact", "chart": "false"})
    result = delivery_report.JOB.run(spark, str(receipts), str(tmp_path / "out"), options)
    assert (result.input.records, result.input.bad) == (1500, 0)
    expected = reference.delivery_summary(records)
    rows = pq.read_table(result.outputs["summary.parquet"]).to_pylist()
    assert len(rows) == len(expected)
    for row in rows:
        key = (int(row["hour"].timestamp()), row["plugin"], row["provider"], row["app_id"])
        for name, value in expected[key].items():
            assert row[name] == (value if value is None else pytest.approx(value)), name
