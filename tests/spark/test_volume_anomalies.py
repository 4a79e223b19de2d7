"""`volume-anomalies` on sparse and far-apart hours: the series is bounded by the data,
and the anomalies are those of the dense series (tests/spark/reference.py)."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from gateway.core.push import Outcome, ProviderKind, Receipt
from spark_plugins import synthetic, volume_anomalies
from spark_plugins.reader import read_receipts
from tests.spark import reference
from tests.spark.conftest import START, receipt

pytestmark = pytest.mark.spark

H = 3600
STRAY = START + round(60 * 365.25) * 86400  # 2085-01-01: a node whose clock is 60 years off


def _rows(path: str) -> list[dict[str, Any]]:
    rows = pq.read_table(path).to_pylist()
    for row in rows:
        row["hour"] = int(row["hour"].timestamp())
    return rows


def listed(
    records: Iterable[dict[str, Any]],
    by: tuple[str, ...],
    baseline_hours: int,
    now: float | None = None,
) -> set[tuple[Any, ...]]:
    """(hour, *group) of the rows the `volume` table lists, as documented: every hour of
    a group with receipts, and each of the `baseline_hours` hours after one, up to the
    newest hour in the data or the last hour that ended by `now`, whichever is later."""
    seen: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    for r in records:
        seen[tuple(r[c] for c in by)].add(reference.hour(r["ts"]))
    last = max(h for hours in seen.values() for h in hours)
    if now is not None:
        last = max(last, reference.hour(now) - H)
    return {
        (h + i * H, *group)
        for group, hours in seen.items()
        for h in hours
        for i in range(baseline_hours + 1)
        if h + i * H <= last
    }


def _traffic(plugin: str, hour: int, volume: int, failures: int = 0) -> list[Receipt]:
    return [
        receipt(
            START + hour * H + j,
            Outcome.TRANSIENT if j < failures else Outcome.OK,
            token="",
            plugin=plugin,
        )
        for j in range(volume)
    ]


def test_a_receipt_decades_away_adds_a_bounded_number_of_hours(spark: Any, tmp_path: Path) -> None:
    """One receipt 60 years after the rest (a wrong clock) used to make every group's
    series ~526,000 hours long. Now the table lists the hours with receipts and the
    `baseline_hours` after each, and the anomalies are those of the dense series."""
    items = []
    for i in range(30):
        if i != 12:  # a silent hour: a drop
            items += _traffic("matrix", i, 200 if i == 20 else 30, 15 if i == 24 else 0)
        if i <= 25:  # then zulip stops: drops until the baseline has emptied
            items += _traffic("zulip", i, 30)
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts / "node-a")
    synthetic.write_with_receipt_writer(
        [receipt(STRAY, Outcome.OK, token="", plugin="matrix")], receipts / "node-b"
    )
    options = volume_anomalies.JOB.resolve_options({})
    result = volume_anomalies.JOB.run(spark, str(receipts), str(tmp_path / "out"), options)

    records = reference.load(receipts)
    stray_hour = reference.hour(STRAY)
    volume = {(r["hour"], r["plugin"]): r for r in _rows(result.outputs["volume.parquet"])}
    # matrix: hours 0-29, the 24 empty hours after them, the stray hour; zulip: 0-25 + 24
    assert len(volume) == result.metrics["group_hours"] == (30 + 24 + 1) + (26 + 24)
    assert set(volume) == listed(records, ("plugin",), 24)
    stray = volume[(stray_hour, "matrix")]
    assert (stray["volume"], stray["baseline_hours"], stray["baseline_volume"]) == (1, 24, 0.0)
    assert (stray["baseline_failure_rate"], stray["complete"]) == (None, False)

    rows = _rows(result.outputs["anomalies.parquet"])
    found = {(r["hour"], r["plugin"], r["kind"]) for r in rows}
    assert found == set(reference.volume_anomalies(records))  # the dense series, in Python
    # the hours before the newest real one: as without the stray receipt
    start, last = int(START), int(START) + 29 * H
    alone = read_receipts(spark, str(receipts / "node-a")).df
    without = volume_anomalies.anomalies(volume_anomalies.hourly_series(alone, options), options)
    early = {a for a in found if a[0] < last}
    assert early == {
        (int(r["hour"]), r["plugin"], r["kind"])
        for r in without.selectExpr("CAST(hour AS LONG) AS hour", "plugin", "kind").collect()
        if r["hour"] < last
    }
    assert {
        (start + 12 * H, "matrix", "volume_drop"),
        (start + 20 * H, "matrix", "volume_spike"),
        (start + 24 * H, "matrix", "failure_spike"),
        (start + 26 * H, "zulip", "volume_drop"),
    } <= early
    # with the stray receipt the data's end is 2085: the hours after 29 are complete, and
    # the silent ones are drops while their baseline still holds receipts
    assert (last + H, "matrix", "volume_drop") in found
    assert (last + 2 * H, "zulip", "volume_drop") in found


def _random_receipts(rng: random.Random, window: int) -> list[Receipt]:
    """Three groups (one with no provider), each active in bursts separated by gaps
    shorter than, as long as, and longer than `window` hours."""
    gaps = [1, 1, 1, 2, window - 1, window, window + 1, 2 * window + 3, 5 * window]
    items = []
    for plugin, provider in (
        ("matrix", ProviderKind.APNS),
        ("matrix", None),
        ("zulip", ProviderKind.FCM),
    ):
        hour = rng.randint(0, 3)
        while hour < 120:
            volume = rng.choice([1, 3, 8, 12, 25, 25, 60])
            failures = rng.choice([0, 0, 0, 1, volume // 2, volume])
            items += [
                receipt(
                    START + hour * H + rng.uniform(0, H - 1),
                    Outcome.TRANSIENT if j < failures else Outcome.OK,
                    token="",
                    plugin=plugin,
                    app_id="nope" if provider is None else "im.vector.app.ios",
                    provider=provider,
                )
                for j in range(volume)
            ]
            hour += rng.choice(gaps)
    return items


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_sparse_series_finds_what_the_dense_series_found(
    spark: Any, tmp_path: Path, seed: int
) -> None:
    """Random bursts and gaps, random options: each listed hour has the numbers of the
    same hour in the dense series, and the anomalies are those of the dense series
    (plain Python, tests/spark/reference.py)."""
    from pyspark.sql import functions as F

    rng = random.Random(seed)
    window = rng.randint(2, 6)
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(_random_receipts(rng, window), receipts)
    records = reference.load(receipts)
    source = read_receipts(spark, str(receipts))
    newest = max(r["ts"] for r in records)
    skipped = kept = 0
    for given in (
        {"by": ("plugin",), "baseline_hours": window, "min_baseline_hours": rng.randint(1, window)},
        {
            "by": ("plugin", "provider"),
            "baseline_hours": rng.randint(1, 8),
            "min_baseline_hours": 1,
            "factor": 1.0,
            "min_volume": 0,
            "min_failures": 0,
            "min_failure_rate": 0.0,
            "now": newest - rng.randint(0, 60) * H,
        },
        {
            "by": (),
            "baseline_hours": rng.randint(1, 8),
            "min_baseline_hours": 1,
            "factor": 1.5,
            "min_volume": 5,
            "min_failures": 3,
            "min_failure_rate": 0.2,
            "now": newest + 10 * H,
        },
    ):
        options = volume_anomalies.JOB.resolve_options(given)
        by, n = tuple(options["by"]), int(options["baseline_hours"])
        series = volume_anomalies.hourly_series(source.df, options)
        found = volume_anomalies.anomalies(series, options)
        hours = [
            r.asDict() for r in series.withColumn("hour", F.col("hour").cast("long")).collect()
        ]
        dense = reference.volume_series(records, by=by, now=options["now"], baseline_hours=n)
        got = {(r["hour"], *(r[c] for c in by)): r for r in hours}
        assert len(got) == len(hours)
        assert set(got) == listed(records, by, n, options["now"]), given
        skipped += len(dense) - len(got)  # hours further than n from any receipt
        kept += sum(row["volume"] == 0 for row in hours)  # empty hours that matter
        for key, row in got.items():
            want = dense[key]
            for name in ("volume", "failures", "baseline_hours", "complete"):
                assert row[name] == want[name], (given, key, name)
            for name in ("failure_rate", "baseline_volume", "baseline_failure_rate"):
                same = (
                    row[name] is None
                    if want[name] is None
                    else row[name] == pytest.approx(want[name], rel=1e-12)
                )
                assert same, (given, key, name, row[name], want[name])
        expected = reference.volume_anomalies(
            records, **{k: v for k, v in options.items() if k not in ("max_bad_lines",)}
        )
        anomalous = {
            (r["hour"], *(r[c] for c in by), r["kind"]): r
            for r in found.withColumn("hour", F.col("hour").cast("long")).collect()
        }
        assert set(anomalous) == set(expected), given
        for key, want in expected.items():
            assert anomalous[key]["volume"] == want["volume"]
            assert anomalous[key]["baseline_volume"] == pytest.approx(want["baseline"], rel=1e-12)
    assert skipped and kept  # the gaps were both longer and shorter than the window


def test_an_outage_up_to_now_is_a_drop(spark: Any, tmp_path: Path) -> None:
    """The whole gateway stops writing receipts and the job runs three hours later with
    `now`: the silent hours since the last receipt that ended by `now` are drops; the
    hour `now` falls in is still filling (it could not be a drop) and is not listed."""
    items: list[Receipt] = []
    for i in range(12):
        items += _traffic("matrix", i, 30)
    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(items, receipts)
    last = int(START) + 11 * H
    now = last + 3 * H + 1800  # half an hour into the third hour after the last one
    options = volume_anomalies.JOB.resolve_options({"now": now})
    result = volume_anomalies.JOB.run(spark, str(receipts), str(tmp_path / "out"), options)

    volume = {r["hour"]: r for r in _rows(result.outputs["volume.parquet"])}
    assert max(volume) == last + 2 * H
    assert [volume[last + i * H]["volume"] for i in (1, 2)] == [0, 0]
    assert [volume[last + i * H]["complete"] for i in (1, 2)] == [True, True]
    found = {(r["hour"], r["kind"]) for r in _rows(result.outputs["anomalies.parquet"])}
    assert found == {(last + H, "volume_drop"), (last + 2 * H, "volume_drop")}
    records = reference.load(receipts)
    assert {(h, kind) for h, _, kind in reference.volume_anomalies(records, now=now)} == found
    assert set(volume) == {h for h, _ in listed(records, ("plugin",), 24, now=now)}
