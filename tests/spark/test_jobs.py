"""The built-in jobs on receipts written by the real `ReceiptWriter`, checked against
plain-Python computations of the same numbers (tests/spark/reference.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from spark_plugins import dead_tokens, delivery_report, synthetic, volume_anomalies
from spark_plugins.reader import read_receipts
from tests.spark import reference

pytestmark = pytest.mark.spark

FIELDS = ["plugin", "app_id", "provider", "token_hash", "reason", "failures", "last_seen"]


def _rows(path: str | Path) -> list[dict[str, Any]]:
    table = pq.read_table(path)
    rows = table.to_pylist()
    for row in rows:
        if "hour" in row and row["hour"] is not None:
            row["hour"] = int(row["hour"].timestamp())
    return rows


@pytest.fixture(scope="module")
def records(receipts_dir: Path) -> list[dict[str, Any]]:
    return reference.load(receipts_dir)


@pytest.fixture(scope="module")
def report(spark: Any, receipts_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("report")
    options = delivery_report.JOB.resolve_options({"percentiles": "exact"})
    return delivery_report.JOB.run(spark, str(receipts_dir), str(out), options)


def test_writer_output_is_what_the_job_reads(report: Any, records: list[dict[str, Any]]) -> None:
    assert report.input.records == len(records) == 6000 + len(_scenario_count())
    assert report.input.bad == 0
    assert report.input.files >= 2  # the second node writes into a subdirectory


def _scenario_count() -> list[Any]:
    from tests.spark.conftest import scenarios

    return scenarios()


def test_delivery_summary_matches_python(report: Any, records: list[dict[str, Any]]) -> None:
    expected = reference.delivery_summary(records)
    rows = _rows(report.outputs["summary.parquet"])
    assert len(rows) == len(expected)
    for row in rows:
        want = expected[(row["hour"], row["plugin"], row["provider"], row["app_id"])]
        for name, value in want.items():
            if isinstance(value, float):
                assert row[name] == pytest.approx(value, rel=1e-9, abs=1e-9), name
            else:
                assert row[name] == value, name


def test_delivery_hourly_and_reasons_match_python(
    report: Any, records: list[dict[str, Any]]
) -> None:
    hourly = {row["hour"]: row for row in _rows(report.outputs["hourly.parquet"])}
    for key, want in reference.delivery_hourly(records).items():
        assert hourly[key]["total"] == want["total"]
        assert hourly[key]["latency_p99"] == pytest.approx(want["latency_p99"], rel=1e-9)
    reasons = {
        (r["hour"], r["plugin"], r["provider"], r["app_id"], r["status"], r["reason"]): r["count"]
        for r in _rows(report.outputs["reasons.parquet"])
    }
    assert reasons == reference.reasons(records)


def test_delivery_report_files(report: Any) -> None:
    csv_lines = Path(report.outputs["summary.csv"]).read_text().splitlines()
    assert csv_lines[0].startswith("hour,plugin,provider,app_id,total,ok,")
    assert len(csv_lines) - 1 == pq.read_table(report.outputs["summary.parquet"]).num_rows
    assert csv_lines[1].split(",")[0].endswith("Z")  # UTC, ISO 8601
    assert Path(report.outputs["chart.png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = Path(report.outputs["index.html"]).read_text()
    assert 'src="data:image/png;base64,' in page and "<table>" in page
    result = json.loads(Path(report.outputs["result-delivery-report.json"]).read_text())
    assert result["metrics"]["receipts"] == report.input.records


@pytest.mark.parametrize("given", [["percentiles=approx", "accuracy=100"], ["sketch_k=100"]])
def test_approximate_percentiles_within_rank_bound(
    spark: Any, receipts_dir: Path, records: list[dict[str, Any]], given: list[str]
) -> None:
    """`approx` (percentile_approx, accuracy 100) and the default `sketch` (KLL, k=100):
    every other number is exact, each percentile is a sample within 2n/100 + 1 ranks."""
    options = delivery_report.JOB.resolve_options(given)
    source = read_receipts(spark, str(receipts_dir))
    tables = delivery_report.build_tables(source.df, options)
    got = {
        row["hour"]: row
        for row in tables["hourly"]
        .withColumn("hour", tables["hourly"]["hour"].cast("long"))
        .collect()
    }
    for hour, want in reference.delivery_hourly(records).items():
        for name in ("total", "ok", "transient", "attempts", "retries", "retried"):
            assert got[hour][name] == want[name], name
        assert got[hour]["latency_mean"] == pytest.approx(want["latency_mean"], rel=1e-9)
        assert got[hour]["latency_max"] == want["latency_max"]
    by_hour: dict[int, list[float]] = {}
    for r in records:
        by_hour.setdefault(reference.hour(r["ts"]), []).extend(reference.sent_latencies([r]))
    for hour, values in by_hour.items():
        ordered = sorted(values)
        n = len(ordered)
        for q in (0.5, 0.95, 0.99):
            value = got[hour][f"latency_p{round(q * 100)}"]
            # percentile_approx returns a sample whose rank is about n/accuracy from q*n;
            # allowed here: 2*n/accuracy + 1 ranks (accuracy=100)
            lo = ordered.index(value)
            hi = n - 1 - ordered[::-1].index(value)
            slack = 2 * n / 100 + 1
            assert lo - slack <= q * n <= hi + slack


@pytest.mark.parametrize("mode", ["sketch", "exact", "approx"])
def test_latency_leaves_out_pushes_refused_before_sending(
    spark: Any, tmp_path: Path, mode: str
) -> None:
    """Pushes refused locally (`attempts` 0, about no latency) count in every count but
    not in the latency columns; a group with no push sent has null latencies."""
    from gateway.core.push import Outcome
    from tests.spark.conftest import START, receipt

    t = START + 2 * 3600
    items = [
        receipt(t + i, Outcome.TRANSIENT, token="", attempts=0, latency=0.0002, reason="queue_full")
        for i in range(6)
    ]
    items += [receipt(t + 10 + i, Outcome.OK, token="", latency=0.1 + i / 100) for i in range(4)]
    items += [  # a push for an app the gateway does not know: no provider, never sent
        receipt(
            t + 20 + i,
            Outcome.PERMANENT,
            token="",
            app_id="nope",
            provider=None,
            attempts=0,
            latency=0.0001,
            reason="unknown_app",
        )
        for i in range(3)
    ]
    synthetic.write_with_receipt_writer(items, tmp_path)
    records = reference.load(tmp_path)
    options = delivery_report.JOB.resolve_options({"percentiles": mode})
    tables = delivery_report.build_tables(read_receipts(spark, str(tmp_path)).df, options)
    summary = {(r["app_id"], r["provider"]): r.asDict() for r in tables["summary"].collect()}
    (hourly,) = [r.asDict() for r in tables["hourly"].collect()]
    sent = summary[("im.vector.app.ios", "apns")]
    refused = summary[("nope", None)]
    assert (sent["total"], sent["ok"], sent["transient"], sent["attempts"]) == (10, 4, 6, 4)
    assert (refused["total"], refused["permanent"], refused["attempts"]) == (3, 3, 0)
    assert hourly["total"] == 13
    latency = ["latency_p50", "latency_p95", "latency_p99", "latency_mean", "latency_max"]
    assert all(refused[name] is None for name in latency)
    for row in (sent, hourly):
        assert row["latency_max"] == 130.0
        assert row["latency_mean"] == pytest.approx(115.0, rel=1e-9)
        for name in latency[:3]:  # sketch and approx give one of the sent latencies
            assert 100.0 <= row[name] <= 130.0, (name, row[name])
    if mode == "exact":
        expected = reference.delivery_summary(records)
        assert len(expected) == len(summary)
        for (_, _, provider, app_id), want in expected.items():
            row = summary[(app_id, provider)]
            for name, value in want.items():
                assert row[name] == (value if value is None else pytest.approx(value)), name
        assert sent["latency_p50"] == pytest.approx(115.0)


def test_page_shows_no_latency_for_a_group_that_sent_nothing(spark: Any, tmp_path: Path) -> None:
    """A group in which no push was sent has null latencies (summary.csv: empty): the
    page's "worst hourly p99" is empty too, not 0 ms, which would read as instant
    deliveries. The page escapes the names receipts carry."""
    import re

    from gateway.core.push import Outcome
    from tests.spark.conftest import START, receipt

    items = [receipt(START + i, Outcome.OK, token="", latency=0.1) for i in range(3)]
    items += [
        receipt(
            START + 10 + i,
            Outcome.PERMANENT,
            token="",
            app_id="<b>nope</b>",
            provider=None,
            attempts=0,
            reason="unknown_app",
        )
        for i in range(2)
    ]
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts)
    result = delivery_report.JOB.run(
        spark, str(receipts), str(tmp_path / "out"), delivery_report.JOB.resolve_options({})
    )
    page = Path(result.outputs["index.html"]).read_text()
    assert "<b>nope</b>" not in page
    rows = {
        cells[2]: cells
        for cells in (
            re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", page)
        )
        if cells
    }
    assert rows["im.vector.app.ios"][3:] == ["3", "100%", "0", "100"]
    assert rows["&lt;b&gt;nope&lt;/b&gt;"][3:] == ["2", "0%", "0", ""]


def test_dead_tokens_file(
    spark: Any, receipts_dir: Path, records: list[dict[str, Any]], tmp_path: Path
) -> None:
    options = dead_tokens.JOB.resolve_options({})
    result = dead_tokens.JOB.run(spark, str(receipts_dir), str(tmp_path), options)
    path = tmp_path / "dead-tokens.jsonl"
    assert result.outputs["dead-tokens.jsonl"] == str(path)
    assert not list(tmp_path.glob("dead-tokens.jsonl.parts"))
    lines = path.read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    for entry in entries:
        assert list(entry) == FIELDS
        assert isinstance(entry["plugin"], str) and isinstance(entry["app_id"], str)
        assert entry["provider"] in ("apns", "fcm", None)
        assert isinstance(entry["token_hash"], str) and len(entry["token_hash"]) == 64
        assert isinstance(entry["reason"], str)
        assert isinstance(entry["failures"], int) and entry["failures"] >= 1
        assert isinstance(entry["last_seen"], float)
    got = {(e["plugin"], e["app_id"], e["provider"], e["token_hash"]): e for e in entries}
    expected = reference.dead_tokens(records)
    assert set(got) == set(expected)
    for key, want in expected.items():
        assert got[key]["reason"] == want["reason"]
        assert got[key]["failures"] == want["failures"]
        assert got[key]["last_seen"] == pytest.approx(want["last_seen"], abs=1e-6)
    # the hand-written histories
    by_hash = {e["token_hash"]: e for e in entries}
    assert by_hash[synthetic.token_hash("dead-perm")]["reason"] == "BadDeviceToken"
    assert by_hash[synthetic.token_hash("dead-perm")]["failures"] == 2
    streak = by_hash[synthetic.token_hash("streak")]
    assert (streak["reason"], streak["failures"], streak["provider"]) == (
        "consecutive_transient_failures",
        6,
        "fcm",
    )
    for alive in ("revived", "outage", "few", "refused"):
        assert synthetic.token_hash(alive) not in by_hash
    assert not any(e["plugin"] == "marmot" for e in entries)
    assert result.metrics["tokens_retired"] == len(entries)


def test_dead_tokens_thresholds_are_options(
    spark: Any, receipts_dir: Path, records: list[dict[str, Any]], tmp_path: Path
) -> None:
    given = ["transient_failures=4", "min_span_hours=0", "window_hours=1000"]
    options = dead_tokens.JOB.resolve_options(given)
    dead_tokens.JOB.run(spark, str(receipts_dir), str(tmp_path), options)
    entries = [json.loads(x) for x in (tmp_path / "dead-tokens.jsonl").read_text().splitlines()]
    hashes = {e["token_hash"] for e in entries}
    assert {synthetic.token_hash(t) for t in ("outage", "few", "streak")} <= hashes
    expected = reference.dead_tokens(records, n=4, min_span_hours=0, window_hours=1000)
    assert len(entries) == len(expected)


def test_dead_tokens_never_retire_what_the_guard_held_or_the_config_refused(
    spark: Any, tmp_path: Path
) -> None:
    """With `permanent` among the permanent statuses, a push refused as malformed
    retires its token, but one the mass-invalidation guard held (`permanent` /
    `invalidation_suspended`: most tokens of the app came back invalid, a wrong
    environment or project) does not: the guard exists so that nothing deletes those
    tokens (docs/delivery.md), and `pushgw tokens retire` would. Nor does one refused
    for its app's configuration (an expired or refused certificate, a wrong topic)."""
    from gateway.core.push import Outcome
    from tests.spark.conftest import START, receipt

    items = [
        receipt(
            START + i,
            Outcome.PERMANENT,
            token=f"held-{i}",
            reason="invalidation_suspended",
        )
        for i in range(3)
    ]
    # refused for the app's configuration: every token of the app gets these alike
    items += [
        receipt(START + 20 + i, Outcome.PERMANENT, token=f"config-{i}", attempts=0, reason=why)
        for i, why in enumerate(("certificate_expired", "certificate_refused", "BadTopic"))
    ]
    items.append(
        receipt(
            START + 10, Outcome.PERMANENT, token="malformed", attempts=0, reason="invalid_payload"
        )
    )
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts)
    records = reference.load(receipts)
    options = dead_tokens.JOB.resolve_options({"permanent_statuses": "token_invalid,permanent"})
    dead_tokens.JOB.run(spark, str(receipts), str(tmp_path / "out"), options)
    lines = (tmp_path / "out" / "dead-tokens.jsonl").read_text().splitlines()
    retired = {json.loads(line)["token_hash"]: json.loads(line)["reason"] for line in lines}
    assert retired == {synthetic.token_hash("malformed"): "invalid_payload"}
    expected = reference.dead_tokens(records, permanent=("token_invalid", "permanent"))
    assert {key[3] for key in expected} == set(retired)


def test_volume_anomalies_match_python(
    spark: Any, receipts_dir: Path, records: list[dict[str, Any]], tmp_path: Path
) -> None:
    options = volume_anomalies.JOB.resolve_options({})
    result = volume_anomalies.JOB.run(spark, str(receipts_dir), str(tmp_path), options)
    rows = _rows(result.outputs["anomalies.parquet"])
    got = {(r["hour"], r["plugin"], r["kind"]): r for r in rows}
    expected = reference.volume_anomalies(records)
    assert set(got) == set(expected)
    for key, want in expected.items():
        assert got[key]["volume"] == want["volume"]
        assert got[key]["baseline_volume"] == pytest.approx(want["baseline"], rel=1e-9)
    h = 3600
    start = int(reference.hour(min(r["ts"] for r in records)))
    assert (start + 30 * h, "matrix", "volume_spike") in got
    assert (start + 40 * h, "status", "failure_spike") in got
    assert Path(result.outputs["anomalies.csv"]).read_text().startswith("hour,plugin,kind,")


def _anomalies(rows: list[dict[str, Any]], by: list[str]) -> set[tuple[Any, ...]]:
    return {(r["hour"], *(r[c] for c in by), r["kind"]) for r in rows}


def test_volume_anomalies_keep_a_null_group(spark: Any, tmp_path: Path) -> None:
    """Pushes for an unknown app have no provider: with `by=provider` they are a group of
    their own (null in Parquet, empty in CSV), counted every hour, spike included."""
    from gateway.core.push import Outcome
    from tests.spark.conftest import START, receipt

    h = 3600
    items = []
    for i in range(31):
        if i not in (10, 11):  # apns silent for two hours: drops
            fails = 15 if i == 25 else 0
            items += [
                receipt(START + i * h + j, Outcome.TRANSIENT if j < fails else Outcome.OK, token="")
                for j in range(30)
            ]
        items += [
            receipt(
                START + i * h + j,
                Outcome.PERMANENT,
                token="",
                app_id="nope",
                provider=None,
                attempts=0,
                reason="unknown_app",
            )
            for j in range(200 if i == 20 else 30)
        ]
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts)
    records = reference.load(receipts)
    start = int(START)
    for by in (["provider"], ["plugin", "provider"]):
        options = volume_anomalies.JOB.resolve_options({"by": by})
        result = volume_anomalies.JOB.run(
            spark, str(receipts), str(tmp_path / "_".join(by)), options
        )
        got = _anomalies(_rows(result.outputs["anomalies.parquet"]), by)
        assert got == set(reference.volume_anomalies(records, by=tuple(by)))
        group = ("matrix",) * (len(by) - 1)
        assert (start + 20 * h, *group, None, "volume_spike") in got
        assert (start + 10 * h, *group, "apns", "volume_drop") in got
        volume = [r for r in _rows(result.outputs["volume.parquet"]) if r["provider"] is None]
        assert len(volume) == 31
        assert {r["volume"] for r in volume} == {30, 200}
    csv_lines = Path(result.outputs["anomalies.csv"]).read_text().splitlines()
    assert "2025-01-01T20:00:00Z,matrix,,volume_spike,200," in "\n".join(csv_lines)


def test_volume_anomalies_do_not_judge_a_filling_hour_a_drop(spark: Any, tmp_path: Path) -> None:
    """The newest hour is incomplete until `now` (default: the newest receipt) has
    passed its end: not a drop, but still judged for spikes."""
    from gateway.core.push import Outcome
    from tests.spark.conftest import START, receipt

    h = 3600
    items = [
        receipt(START + i * h + j, Outcome.OK, token="", plugin=plugin)
        for i in range(10)
        for j in range(30)
        for plugin in ("matrix", "zulip")
    ]
    items += [receipt(START + 10 * h + j, Outcome.OK, token="") for j in range(2)]
    items += [receipt(START + 10 * h + j, Outcome.OK, token="", plugin="zulip") for j in range(200)]
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts)
    records = reference.load(receipts)
    source = read_receipts(spark, str(receipts))
    start, last = int(START), int(START) + 10 * h
    spike = (last, "zulip", "volume_spike")
    drop = (last, "matrix", "volume_drop")
    for now, want in [(None, {spike}), (last + 1800.0, {spike}), (last + h, {spike, drop})]:
        options = volume_anomalies.JOB.resolve_options({"now": now})
        series = volume_anomalies.hourly_series(source.df, options)
        rows = [
            {**r.asDict(), "hour": int(r["hour"].timestamp())}
            for r in volume_anomalies.anomalies(series, options).collect()
        ]
        assert (
            _anomalies(rows, ["plugin"])
            == want
            == set(reference.volume_anomalies(records, now=now))
        ), now
        complete = {
            int(r["hour"].timestamp()): r["complete"]
            for r in series.where("plugin = 'matrix'").collect()
        }
        assert complete == {start + i * h: i < 10 or now == last + h for i in range(11)}


def test_malformed_lines_are_counted_with_file_and_line(spark: Any, tmp_path: Path) -> None:
    receipts = tmp_path / "receipts"
    receipts.mkdir()
    items = list(synthetic.receipts(3000, seed=9, tokens=50))
    synthetic.write_with_receipt_writer(items, receipts, roll_bytes=10**9)
    (good,) = receipts.glob("*.jsonl")
    lines = good.read_text().splitlines(keepends=True)
    bad_at = {
        5: '{"v":1,"ts":17356',
        1200: "not json at all",
        2999: '{"v": 1}',
        3001: '{"v":1,"ts":"yesterday"}',
    }
    inserts = {**bad_at, 1501: ""}  # an empty line is ignored, but it is a line
    for line_no in sorted(inserts):  # 1-based positions in the final file
        lines.insert(line_no - 1, inserts[line_no] + "\n")
    good.write_text("".join(lines))
    (receipts / "wrong-version.jsonl").write_text(lines[0].replace('"v":1', '"v":2'))
    (receipts / "truncated.jsonl").write_text(lines[0][:40])  # no newline at the end
    # small splits: the 1 MB file is read by several tasks, line numbers must still hold
    spark.conf.set("spark.sql.files.maxPartitionBytes", "65536")
    try:
        source = read_receipts(spark, str(receipts))
        assert source.df.count() == 3000
        stats = source.stats()
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    assert stats.records == 3000
    assert stats.bad == len(bad_at) + 2
    located = {(Path(b.file).name, b.line) for b in stats.bad_lines}
    assert located == {(good.name, n) for n in bad_at} | {
        ("wrong-version.jsonl", 1),
        ("truncated.jsonl", 1),
    }
    assert len(stats.bad_files) == 3


def test_job_survives_bad_lines(spark: Any, tmp_path: Path) -> None:
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(200, seed=4)), receipts)
    (receipts / "broken.jsonl").write_text('{"v":1,"ts":1735689600.5,"push_id"\n')
    options = volume_anomalies.JOB.resolve_options({})
    result = volume_anomalies.JOB.run(spark, str(receipts), str(tmp_path / "out"), options)
    assert (result.input.records, result.input.bad) == (200, 1)
    assert result.input.bad_lines[0].line == 1


def test_empty_directory_gives_empty_reports(spark: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "receipts-20250101T000000Z-1-0001.jsonl.open").write_text("{}\n")  # being written
    for job in (delivery_report.JOB, dead_tokens.JOB, volume_anomalies.JOB):
        out = tmp_path / job.name
        result = job.run(spark, str(empty), str(out), job.resolve_options({}))
        assert result.input.records == 0 and result.input.files == 0
    assert (tmp_path / "dead-tokens" / "dead-tokens.jsonl").read_text() == ""
    summary = (tmp_path / "delivery-report" / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("hour,plugin,") and len(summary) == 1
    assert (tmp_path / "delivery-report" / "chart.png").exists()
    assert pq.read_table(tmp_path / "volume-anomalies" / "anomalies.parquet").num_rows == 0


def test_missing_directory_is_an_error(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="receipts directory not found"):
        read_receipts(spark, str(tmp_path / "nope"))


def test_parquet_receipts_are_read_too(spark: Any, tmp_path: Path) -> None:
    import pyarrow as pa

    from gateway.core.receipts import receipt_record

    receipts = tmp_path / "receipts"
    items = list(synthetic.receipts(300, seed=5))
    synthetic.write_with_receipt_writer(items[:100], receipts)
    table = pa.Table.from_pylist([receipt_record(r) for r in items[100:]])
    pq.write_table(table, receipts / "receipts-20250101T000000Z-9-0001.parquet")
    source = read_receipts(spark, str(receipts))
    total = source.df.groupBy().sum("latency_ms").first()[0]
    assert source.stats().records == 300
    assert math.isclose(total, sum(round(r.latency * 1000, 3) for r in items), rel_tol=1e-9)


def test_writer_parquet_reads_like_its_jsonl(spark: Any, tmp_path: Path) -> None:
    items = list(synthetic.receipts(2000, seed=6))
    as_jsonl, as_parquet = tmp_path / "jsonl", tmp_path / "parquet"
    synthetic.write_with_receipt_writer(items, as_jsonl)
    synthetic.write_with_receipt_writer(items, as_parquet, file_format="parquet")
    assert {p.suffix for p in as_parquet.iterdir()} == {".parquet"}
    from_jsonl = read_receipts(spark, str(as_jsonl))
    from_parquet = read_receipts(spark, str(as_parquet))
    rows = {r["push_id"]: r.asDict() for r in from_jsonl.df.collect()}
    assert rows == {r["push_id"]: r.asDict() for r in from_parquet.df.collect()}
    assert len(rows) == 2000 and rows[items[0].push_id]["ts"] == round(items[0].finished_at, 6)
    assert (from_parquet.stats().records, from_parquet.stats().bad) == (2000, 0)


@pytest.mark.parametrize("job", [delivery_report.JOB, dead_tokens.JOB, volume_anomalies.JOB])
def test_cached_results_are_read_in_few_tasks_under_a_cluster_partition_count(
    spark: Any, receipts_dir: Path, tmp_path: Path, job: Any
) -> None:
    """With Spark's cluster default of 200 shuffle partitions, the jobs' cached (small)
    results are coalesced by adaptive execution: no stage runs one task per partition."""
    sc = spark.sparkContext
    partitions = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "200")
    group = f"partitions-{job.name}"
    sc.setJobGroup(group, group)
    try:
        job.run(
            spark,
            str(receipts_dir),
            str(tmp_path),
            job.resolve_options({"chart": "false"} if job is delivery_report.JOB else {}),
        )
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        spark.conf.set("spark.sql.shuffle.partitions", partitions)
    tracker = sc.statusTracker()
    stages = [
        tracker.getStageInfo(stage)
        for job_id in tracker.getJobIdsForGroup(group)
        for stage in tracker.getJobInfo(job_id).stageIds
    ]
    tasks = [info.numTasks for info in stages if info is not None]
    assert tasks and max(tasks) < 200, tasks


def test_write_table_keeps_a_callers_cache_and_drops_its_own(spark: Any, tmp_path: Path) -> None:
    """A job that cached a table to use it again (volume-anomalies' series) keeps that
    cache after writing it; a table write_table cached itself is not left cached."""
    from spark_plugins.output import write_table

    table = spark.range(30).selectExpr("id % 3 AS k").groupBy("k").count()
    callers = table.persist()
    try:
        _, rows = write_table(callers, str(tmp_path), "kept", ["k"], collect=True)
        assert callers.is_cached
        assert [r["count"] for r in rows] == [10, 10, 10]
    finally:
        callers.unpersist()
    fresh = table.where("k > 0")
    write_table(fresh, str(tmp_path), "own", ["k"])
    assert not fresh.is_cached
    assert (tmp_path / "own.csv").read_text().splitlines() == ["k,count", "1,10", "2,10"]


def test_a_collected_table_is_written_as_spark_writes_one(spark: Any, tmp_path: Path) -> None:
    """A table the job collects is written from the driver: its CSV is byte for byte
    Spark's (RFC 4180 quoting, UTC times, nulls empty, same order: nulls first, strings
    by code point), its Parquet reads back the same, with UTC timestamps, and an earlier
    table of that name is replaced whole."""
    import csv

    from spark_plugins.output import write_table

    df = spark.createDataFrame(
        [
            (7200, "z", 0.5, True),
            (3600, 'app "b", west', 1.0, False),
            (3600, None, 0.25, None),
            (3600, "\u00e9t\u00e9", 2.0, True),
            (3600, "Zulu", 1.5, False),
        ],
        "at LONG, app STRING, rate DOUBLE, flag BOOLEAN",
    ).selectExpr("timestamp_seconds(at) AS hour", "app", "rate", "flag")
    stale = tmp_path / "driver" / "t.parquet"
    stale.mkdir(parents=True)
    (stale / "part-old.parquet").write_bytes(b"not this")

    paths, rows = write_table(df, str(tmp_path / "driver"), "t", ["hour", "app"], collect=True)
    spark_paths, none = write_table(df, str(tmp_path / "spark"), "t", ["hour", "app"])

    assert none == []
    assert [(r["hour"], r["app"]) for r in rows] == [
        (3600, None),
        (3600, "Zulu"),
        (3600, 'app "b", west'),
        (3600, "\u00e9t\u00e9"),
        (7200, "z"),
    ]
    driver_csv = Path(paths["t.csv"]).read_text()
    assert driver_csv == Path(spark_paths["t.csv"]).read_text()
    assert driver_csv.splitlines()[:3] == [
        "hour,app,rate,flag",
        "1970-01-01T01:00:00Z,,0.25,",
        "1970-01-01T01:00:00Z,Zulu,1.5,false",
    ]
    assert list(csv.reader(driver_csv.splitlines()))[3][1] == 'app "b", west'
    assert sorted(p.name for p in Path(paths["t.parquet"]).iterdir()) == [
        "_SUCCESS",
        "part-00000.snappy.parquet",
    ]
    for path in (paths["t.parquet"], spark_paths["t.parquet"]):
        assert str(pq.read_table(path).schema.field("hour").type) == "timestamp[us, tz=UTC]"
    assert spark.read.parquet(paths["t.parquet"]).collect() == df.orderBy("hour", "app").collect()


def test_both_csv_writers_keep_carriage_returns_and_edge_whitespace(
    spark: Any, tmp_path: Path
) -> None:
    """A text value with a bare CR, a CRLF or an LF is quoted (RFC 4180) and one with
    leading or trailing spaces or tabs is written as it is, by the driver and by Spark
    alike: a CSV reader gets every value back exactly, as the Parquet files hold it."""
    import csv
    import io

    from spark_plugins.output import write_table

    apps = [
        "cr\rapp",
        "crlf\r\napp",
        "lf\napp",
        "ends in cr\r",
        " spaced ",
        "\ttab",
        "trail\t",
        "  both \t ",
        'app "b", west',
        "plain",
    ]
    df = spark.createDataFrame(list(enumerate(apps)), "id LONG, app STRING")

    paths, _ = write_table(df, str(tmp_path / "driver"), "t", ["id"], collect=True)
    spark_paths, _ = write_table(df, str(tmp_path / "spark"), "t", ["id"])

    driver_csv = Path(paths["t.csv"]).read_bytes()
    spark_csv = Path(spark_paths["t.csv"]).read_bytes()
    assert b'0,"cr\rapp"\n' in driver_csv
    assert b"4, spaced \n" in spark_csv
    assert driver_csv == spark_csv
    for written in (driver_csv, spark_csv):
        read = list(csv.reader(io.StringIO(written.decode(), newline="")))
        assert read == [["id", "app"], *([str(i), app] for i, app in enumerate(apps))]
    for path in (paths["t.parquet"], spark_paths["t.parquet"]):
        assert pq.read_table(path).column("app").to_pylist() == apps


def test_sql_conf_puts_back_what_was_there_even_after_an_error(spark: Any) -> None:
    from spark_plugins.session import sql_conf

    set_before, unset_before = "spark.sql.shuffle.partitions", "spark.pushgw.test.unset"
    before = spark.conf.get(set_before)
    with pytest.raises(RuntimeError), sql_conf(spark, {set_before: "7", unset_before: "x"}):
        assert (spark.conf.get(set_before), spark.conf.get(unset_before)) == ("7", "x")
        raise RuntimeError("job failed")
    assert spark.conf.get(set_before) == before
    assert spark.conf.get(unset_before, None) is None


def test_with_sql_conf_holds_for_the_run_only(spark: Any) -> None:
    from spark_plugins.jobs import JobResult, with_sql_conf

    key = "spark.pushgw.test.tuned"
    seen: list[str | None] = []

    @with_sql_conf(lambda options: {key: str(options["n"])})
    def run(spark: Any, receipts_dir: str, out_dir: str, options: Any) -> JobResult:
        seen.append(spark.conf.get(key, None))
        return JobResult("tuned")

    assert run(spark, "in", "out", {"n": 3}).job == "tuned"
    assert seen == ["3"]
    assert spark.conf.get(key, None) is None
    assert run.__wrapped__(spark, "in", "out", {"n": 3}).job == "tuned"  # type: ignore[attr-defined]
    assert seen == ["3", None]


@pytest.mark.parametrize("job", [delivery_report.JOB, dead_tokens.JOB])
def test_jobs_tune_their_aggregation_without_changing_the_session(
    spark: Any, receipts_dir: Path, tmp_path: Path, job: Any
) -> None:
    """Jobs share a session (`pushgw spark run JOB JOB`): what one sets for its own
    aggregation is gone when the next job starts."""
    from spark_plugins.session import BYPASS_PARTIAL_AGGREGATION, OBJECT_HASH_GROUPS

    spark.conf.set(OBJECT_HASH_GROUPS, "777")
    try:
        options = job.resolve_options({"chart": "false"} if job is delivery_report.JOB else {})
        job.run(spark, str(receipts_dir), str(tmp_path), options)
        assert spark.conf.get(OBJECT_HASH_GROUPS) == "777"
        assert spark.conf.get(BYPASS_PARTIAL_AGGREGATION, None) is None
    finally:
        spark.conf.unset(OBJECT_HASH_GROUPS)


def test_dead_tokens_aggregates_each_token_once_after_the_shuffle(
    spark: Any, receipts_dir: Path
) -> None:
    """A token has few receipts per input split, so the job skips Spark's partial
    aggregation (which would build a map as large as its input) on Spark 4.3+."""
    import pyspark

    from spark_plugins.session import sql_conf

    if tuple(int(p) for p in pyspark.__version__.split(".")[:2]) < (4, 3):
        pytest.skip("bypassing the partial aggregation needs Spark 4.3")
    options = dead_tokens.JOB.resolve_options({})
    tokens = dead_tokens.per_token(read_receipts(spark, str(receipts_dir)).df, options)
    tokens.createOrReplaceTempView("pushgw_test_tokens")

    def plan() -> str:
        return str(spark.sql("EXPLAIN SELECT * FROM pushgw_test_tokens").first()[0])

    assert "partial_collect_list" in plan()  # Spark's default: two aggregation phases
    with sql_conf(spark, dead_tokens.aggregation_conf(options)):
        once = plan()
    assert "collect_list" in once and "partial_" not in once, once
