"""`volume-anomalies`: hours whose volume or failure rate departs from the trailing baseline.

Receipts are counted per UTC hour and group (option `by`, default `plugin`; any of
`plugin`, `provider`, `app_id`, comma-separated, or empty for the whole gateway). A null
group value (`provider` of a push for an unknown app) is a group of its own: null in
Parquet, an empty field in CSV. Each group's series runs from its first hour to the
newest hour in the data, or to the last hour that ended by `now` when that is later (an
hour without receipts has volume 0: a silent hour is a drop, not a gap; so a gateway
that stopped writing receipts before `now` shows drops). For each hour, the baseline is
the previous `baseline_hours` hours of that series (default 24; the hour itself is not
included, nor hours before the group's first); an hour is judged only once
`min_baseline_hours` (default 6) of history exist. Only the hours that can matter are
materialised: each hour with receipts and the `baseline_hours` hours after it. An hour
further than that from any receipt has volume 0 and a baseline of zeros, so it is never
an anomaly and adds nothing to a later baseline; leaving it out keeps the series as
large as the data, not as long as its time span (one receipt from a node whose clock is
decades off would otherwise add up to ~876,000 hours, 2000 to 2099, per group).

An hour is complete when it ended at or before `now` (option, unix seconds; default:
the newest receipt's time, so the newest hour is incomplete). An incomplete hour is
still filling: it is never judged a `volume_drop` (its volume can only grow), but it is
judged for spikes. Over a running gateway, receipts become readable only when their
file rolls (docs/receipts.md); with several writers, give `now` = the time of the run
minus `receipts.roll_seconds` so that hours still missing a writer's open file are not
judged for drops either.

With `factor` F (default 3):

- `volume_spike`: volume > F x baseline mean volume, and volume >= `min_volume` (20);
- `volume_drop`: volume < baseline mean volume / F, and the baseline mean >= `min_volume`;
- `failure_spike`: failure rate (non-`ok` / volume) > F x max(baseline failure rate,
  `min_failure_rate` (0.01)), and failures >= `min_failures` (10). The baseline
  failure rate is the baseline hours' failures over their volume.

Outputs: `anomalies.parquet/` + `anomalies.csv` (hour, group, kind, volume,
baseline_volume, failures, failure_rate, baseline_failure_rate, ratio) and
`volume.parquet/` + `volume.csv` (hour, group, volume, failures, failure_rate,
baseline_hours, baseline_volume, baseline_failure_rate, complete): for each group, every
hour with receipts and each of the `baseline_hours` hours after one, up to the newest
hour in the data or the last one that ended by `now`. Its rows are `group_hours` in the
result.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spark_plugins.jobs import JAVA_INT_MAX, JobOption, JobResult, OptionError, SparkJob, progress
from spark_plugins.output import ensure_dir, write_result, write_table
from spark_plugins.reader import MAX_BAD_LINES, TS_MAX, read_receipts, report_bad_input

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

NAME = "volume-anomalies"
GROUPABLE = ("plugin", "provider", "app_id")


def _distinct(columns: tuple[str, ...]) -> None:
    for i, column in enumerate(columns):
        if column in columns[:i]:
            raise ValueError(f"column {column!r} named twice")


OPTIONS = (
    JobOption(
        "by",
        tuple,
        ("plugin",),
        "group columns: plugin, provider, app_id (or empty)",
        choices=GROUPABLE,
        check=_distinct,
    ),
    JobOption(
        "factor",
        float,
        3.0,
        "how far from the baseline counts as an anomaly",
        minimum=1,  # below 1, an hour at its baseline would be both a spike and a drop
    ),
    JobOption(
        "baseline_hours",
        int,
        24,
        "trailing hours that make the baseline",
        minimum=1,
        maximum=JAVA_INT_MAX,  # in seconds, it still fits in a long
    ),
    JobOption(
        "min_baseline_hours",
        int,
        6,
        "hours of history needed before judging (<= baseline_hours)",
        minimum=1,
        maximum=JAVA_INT_MAX,
    ),
    JobOption("min_volume", int, 20, "smallest volume (or baseline) judged for volume", minimum=0),
    JobOption("min_failures", int, 10, "smallest failure count judged for failure rate", minimum=0),
    JobOption(
        "min_failure_rate",
        float,
        0.01,
        "floor of the baseline failure rate",
        minimum=0,
        maximum=1,
    ),
    JobOption(
        "now",
        float,
        None,
        "hours ending after this unix time are incomplete (default: newest receipt)",
        minimum=0,
        maximum=TS_MAX,  # receipts' range: beyond, hours overflow a long
    ),
    MAX_BAD_LINES,
)


def check_options(options: Mapping[str, Any]) -> None:
    """The baseline window holds at most `baseline_hours`: needing more judges nothing."""
    need, have = int(options["min_baseline_hours"]), int(options["baseline_hours"])
    if need > have:
        raise OptionError(
            f"min_baseline_hours ({need}) is more than baseline_hours ({have}): "
            "no hour could be judged"
        )


def hourly_series(receipts: DataFrame, options: Mapping[str, Any]) -> DataFrame:
    """Hourly series per group with the trailing baseline of each hour.

    The baseline of hour h is over the group's dense series: every hour from its first
    hour to the newest hour in the data (or the last one that ended by `now`, when
    later), an hour without receipts being volume 0. Only the hours that can matter are
    listed: each hour with receipts and the `baseline_hours` hours after it (up to the
    next hour with receipts and to the series' last hour). An hour further than that
    from any receipt has volume 0 and a baseline of zeros, so it is never an anomaly,
    and it adds nothing to a later hour's baseline sums: those are summed over a range
    of hours, and divided by the number of hours the dense series has there
    (`baseline_hours`, fewer near the group's first hour). So a receipt years away from
    the rest (a wrong clock) adds at most `baseline_hours` + 1 rows per group, not one
    per hour between.

    Null group values (a push for an unknown app has no provider) form a group of their
    own: window partitions keep nulls together.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    by = list(options["by"])  # checked by the option: known columns, each once
    n = int(options["baseline_hours"])
    hour = (F.floor(F.col("ts") / 3600) * 3600).cast("long")
    counts = receipts.groupBy(hour.alias("h"), *by).agg(
        F.count(F.lit(1)).alias("volume"),
        F.count(F.when(F.col("status") != "ok", 1)).alias("failures"),
        F.max("ts").alias("newest"),
    )
    now = options.get("now")
    end = F.lit(float(now)) if now is not None else F.max("newest")
    last = F.max("h")
    if now is not None:  # the hours since the newest receipt that ended by `now` are silent
        ended = int(float(now) // 3600 * 3600) - 3600
        last = F.greatest(last, F.lit(ended).cast("long"))
    bounds = counts.agg(last.alias("last"), end.alias("end"))
    group = Window.partitionBy(*by) if by else Window.partitionBy()
    in_order = group.orderBy("h")
    # each hour with receipts, then the empty hours before the group's next one: at most
    # n of them (the ones whose baseline still holds this hour), none past the newest
    upto = F.least(
        F.coalesce(F.lead("h").over(in_order) - 3600, F.col("last")),
        F.col("h") + F.lit(n * 3600).cast("long"),
    )
    runs = counts.crossJoin(bounds).select(
        *by,
        "h",
        "volume",
        "failures",
        "end",
        F.min("h").over(group).alias("first"),
        upto.alias("upto"),
    )
    spread = runs.select(
        *by,
        "volume",
        "failures",
        "end",
        "first",
        F.posexplode(F.sequence("h", "upto", F.lit(3600).cast("long"))).alias("i", "hour_s"),
    )
    series = spread.select(
        F.col("hour_s").alias("h"),
        *by,
        F.when(F.col("i") == 0, F.col("volume")).otherwise(F.lit(0).cast("long")).alias("volume"),
        F.when(F.col("i") == 0, F.col("failures"))
        .otherwise(F.lit(0).cast("long"))
        .alias("failures"),
        "first",
        ((F.col("hour_s") + 3600) <= F.col("end")).alias("complete"),
    )
    # the previous n hours by time, not by row: unlisted hours count as 0
    trailing = in_order.rangeBetween(-n * 3600, -3600)
    held = F.least(F.lit(n).cast("long"), ((F.col("h") - F.col("first")) / 3600).cast("long"))
    base_volume = F.coalesce(F.sum("volume").over(trailing), F.lit(0).cast("long"))
    base_failures = F.coalesce(F.sum("failures").over(trailing), F.lit(0).cast("long"))
    return series.select(
        F.timestamp_seconds("h").alias("hour"),
        *by,
        "volume",
        "failures",
        F.try_divide(F.col("failures"), F.col("volume")).alias("failure_rate"),
        held.alias("baseline_hours"),
        F.when(held > 0, base_volume / held).alias("baseline_volume"),
        F.try_divide(base_failures, base_volume).alias("baseline_failure_rate"),
        "complete",
    )


def anomalies(series: DataFrame, options: Mapping[str, Any]) -> DataFrame:
    from pyspark.sql import functions as F

    by = list(options["by"])
    factor = float(options["factor"])  # >= 1, checked by the option
    judged = F.col("baseline_hours") >= int(options["min_baseline_hours"])
    volume, base = F.col("volume"), F.col("baseline_volume")
    rate_floor = F.greatest(
        F.coalesce(F.col("baseline_failure_rate"), F.lit(0.0)),
        F.lit(float(options["min_failure_rate"])),
    )
    kinds = F.array_compact(
        F.array(
            F.when(
                judged & (volume >= int(options["min_volume"])) & (volume > base * factor),
                F.lit("volume_spike"),
            ),
            F.when(
                judged
                & F.col("complete")  # a still-filling hour's volume can only grow
                & (base >= int(options["min_volume"]))
                & (volume < base / factor),
                F.lit("volume_drop"),
            ),
            F.when(
                judged
                & (F.col("failures") >= int(options["min_failures"]))
                & (F.col("failure_rate") > rate_floor * factor),
                F.lit("failure_spike"),
            ),
        )
    )
    flagged = series.withColumn("kind", F.explode(kinds))
    ratio = (
        F.when(F.col("kind") == "failure_spike", F.try_divide(F.col("failure_rate"), rate_floor))
        .when(base > 0, F.try_divide(volume, base))
        .otherwise(F.lit(None))
    )
    return flagged.select(
        "hour",
        *by,
        "kind",
        "volume",
        "baseline_volume",
        "failures",
        "failure_rate",
        "baseline_failure_rate",
        ratio.alias("ratio"),
    )


def run(
    spark: SparkSession, receipts_dir: str, out_dir: str, options: Mapping[str, Any]
) -> JobResult:
    from pyspark import StorageLevel

    started = time.monotonic()
    source = read_receipts(spark, receipts_dir, max_reported=int(options["max_bad_lines"]))
    series = hourly_series(source.df, options).persist(StorageLevel.MEMORY_AND_DISK)
    result = JobResult(NAME)
    try:
        progress(NAME, f"reading receipts from {receipts_dir}", started)
        ensure_dir(spark, out_dir)
        by = list(options["by"])
        paths, _ = write_table(series, out_dir, "volume", [*by, "hour"])
        result.outputs.update(paths)
        group_hours = series.count()  # cached: not collected to the driver to be counted
        result.input = source.stats()
        report_bad_input(result.input)
        found = anomalies(series, options)
        paths, rows = write_table(found, out_dir, "anomalies", ["hour", *by, "kind"], collect=True)
        result.outputs.update(paths)
        kinds: dict[str, int] = {}
        for row in rows:
            kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    finally:
        series.unpersist()
    result.metrics = {
        "group_hours": group_hours,
        "anomalies": sum(kinds.values()),
        "by_kind": kinds,
    }
    return write_result(spark, out_dir, result, started)


JOB = SparkJob(
    name=NAME,
    description="Hours whose volume or failure rate departs from the trailing baseline "
    "by a factor; Parquet + CSV",
    run=run,
    options=OPTIONS,
    submit_script="volume_anomalies.py",
    check=check_options,
)
