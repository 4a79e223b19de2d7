"""`delivery-report`: per hour x plugin x provider x app delivery numbers, chart and page.

Outputs (in `--out`):

- `summary.parquet/`, `summary.csv`: one row per (hour, plugin, provider, app_id):
  `total`, one count per final status (`ok`, `token_invalid`, `permanent`, `auth`,
  `throttled`, `transient`, `other` for any status this version does not know),
  `success_rate` (`ok / total`), `attempts` (provider requests), `retries`
  (sum of `attempts - 1` over pushes with at least one attempt), `retried` (pushes with
  more than one attempt), `latency_p50/p95/p99/mean/max` in milliseconds.

  Latencies are over the pushes that reached a provider (`attempts >= 1`) only: a push
  the gateway refused or dropped before sending (`queue_full`, `payload_too_large`,
  `unknown_app`, ... with `attempts` 0) ends in about no time and would drag the
  percentiles down. Every count is over all pushes. A group in which no push was sent
  has null latency columns.
- `reasons.parquet/`, `reasons.csv`: (hour, plugin, provider, app_id, status, reason) ->
  `count`; `reason` is empty when the receipt has none.
- `hourly.parquet/`, `hourly.csv`: the same numbers over all plugins and apps, per hour.
- `chart.png` (volume, success rate, latency percentiles over time) and `index.html`, a
  self-contained page (the chart is embedded) with the totals and the input report.

Percentiles (option `percentiles`): `sketch` (default, Spark 4.1.2+) aggregates the input
once at the finest grain (hour, plugin, provider, app, status, reason) with a KLL
quantile sketch of latencies (`kll_sketch_agg_double`, size `sketch_k`, default 1000);
the summary and hourly tables merge those sketches, so the input is read and grouped
once. A sketch holding at most k values is exact (nearest rank: the smallest value whose
rank reaches q*n); beyond, the rank error is about 1.65% at k=200 and 0.3% at k=1000.
On Spark < 4.1.2 `sketch` falls back to `approx`.
`exact` is Spark's `percentile`, linear
interpolation between the two closest ranks, the same definition as numpy's default
(`method="linear"`): for n sorted values the q-quantile is at 0-based rank q*(n-1).
`approx` is `percentile_approx` with `accuracy` (default 10000): the result is one of
the group's values, whose rank is off by about n/accuracy at most (the tests allow
2n/accuracy + 1); it needs bounded memory per group, so it suits huge groups.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from spark_plugins import render
from spark_plugins.jobs import (
    JAVA_INT_MAX,
    JobOption,
    JobResult,
    OptionError,
    SparkJob,
    progress,
    with_sql_conf,
)
from spark_plugins.output import (
    ensure_dir,
    join,
    remove_file,
    write_bytes,
    write_result,
    write_table,
)
from spark_plugins.reader import MAX_BAD_LINES, STATUSES, read_receipts, report_bad_input
from spark_plugins.session import OBJECT_HASH_GROUPS

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

NAME = "delivery-report"
GROUP = ("plugin", "provider", "app_id")
QUANTILES = (0.5, 0.95, 0.99)

OPTIONS = (
    JobOption(
        "percentiles",
        str,
        "sketch",
        "sketch (KLL, one pass), exact, or approx",
        choices=("sketch", "exact", "approx"),
    ),
    JobOption(
        "sketch_k",
        int,
        1000,
        "KLL sketch size k when percentiles=sketch",
        minimum=8,  # kll_sketch_agg_double's range
        maximum=65535,
    ),
    JobOption(
        "accuracy",
        int,
        10000,
        "percentile_approx accuracy when percentiles=approx",
        minimum=1,
        maximum=JAVA_INT_MAX,
    ),
    JobOption(
        "hash_groups",
        int,
        100_000,
        "groups a task aggregates in memory before sorting (objectHashAggregate fallback)",
        minimum=1,
        maximum=JAVA_INT_MAX,
    ),
    JobOption("chart", bool, True, "draw chart.png and index.html"),
    MAX_BAD_LINES,
)


def hour_col(ts: Column) -> Column:
    """Start of the UTC hour of a unix time, as a timestamp."""
    from pyspark.sql import functions as F

    return F.timestamp_seconds((F.floor(ts / 3600) * 3600).cast("long"))


def sent_latency() -> Column:
    """`latency_ms` of a push that reached a provider (`attempts >= 1`), else null: the
    latency columns are over sent pushes only (aggregates skip nulls)."""
    from pyspark.sql import functions as F

    return F.when(F.col("attempts") >= 1, F.col("latency_ms"))


def _latency_aggs(options: Mapping[str, Any]) -> list[Column]:
    from pyspark.sql import functions as F

    mode = options["percentiles"]
    latency = sent_latency()
    quantiles = F.array(*[F.lit(q) for q in QUANTILES])
    if mode == "exact":
        pct = F.percentile(latency, quantiles)
    elif mode == "approx":
        pct = F.percentile_approx(latency, quantiles, int(options["accuracy"]))
    else:  # the option's choices rule this out for resolved options
        raise OptionError(f"option percentiles: exact or approx here, not {mode!r}")
    return [
        pct.alias("_pct"),
        F.avg(latency).alias("latency_mean"),
        F.max(latency).alias("latency_max"),
    ]


def _count_aggs() -> list[Column]:
    from pyspark.sql import functions as F

    status = F.col("status")
    aggs = [F.count(F.lit(1)).alias("total")]
    aggs += [F.count(F.when(status == s, 1)).alias(s) for s in STATUSES]
    aggs.append(F.count(F.when(~status.isin(*STATUSES), 1)).alias("other"))
    aggs += [
        F.sum("attempts").alias("attempts"),
        F.sum(F.greatest(F.col("attempts") - 1, F.lit(0))).alias("retries"),
        F.count(F.when(F.col("attempts") > 1, 1)).alias("retried"),
    ]
    return aggs


def _finish(df: DataFrame, keys: list[str]) -> DataFrame:
    from pyspark.sql import functions as F

    cols: list[Column | str] = [
        *keys,
        "total",
        *STATUSES,
        "other",
        (F.col("ok") / F.col("total")).alias("success_rate"),
        "attempts",
        "retries",
        "retried",
        *[F.col("_pct")[i].alias(f"latency_p{round(q * 100)}") for i, q in enumerate(QUANTILES)],
        "latency_mean",
        "latency_max",
    ]
    return df.select(*cols)


def has_sketches() -> bool:
    """Whether this Spark has the KLL quantile sketch functions the job uses (Spark
    4.1.2+: 4.1.0 and 4.1.1 have `kll_sketch_agg_double` but no `kll_merge_agg_double`)."""
    from pyspark.sql import functions as F

    used = ("kll_sketch_agg_double", "kll_merge_agg_double", "kll_sketch_get_quantile_double")
    return all(hasattr(F, name) for name in used)


def fine_rows(receipts: DataFrame, options: Mapping[str, Any]) -> DataFrame:
    """One aggregation over the input at the finest grain (the reasons table's), with a
    KLL sketch of the latencies of each row's sent pushes (`_sent` of them)."""
    from pyspark.sql import functions as F

    latency = sent_latency()
    return receipts.groupBy(hour_col(F.col("ts")).alias("hour"), *GROUP, "status", "reason").agg(
        F.count(F.lit(1)).alias("count"),
        F.sum("attempts").alias("attempts"),
        F.sum(F.greatest(F.col("attempts") - 1, F.lit(0))).alias("retries"),
        F.count(F.when(F.col("attempts") > 1, 1)).alias("retried"),
        F.count(latency).alias("_sent"),
        F.sum(latency).alias("_latency_sum"),
        F.max(latency).alias("latency_max"),
        F.kll_sketch_agg_double(latency, int(options["sketch_k"])).alias("_sketch"),
    )


def tables_from_fine(fine: DataFrame) -> dict[str, DataFrame]:
    """Summary, hourly and reasons by merging the finest-grain rows and their sketches."""
    from pyspark.sql import functions as F

    keys = ["hour", *GROUP]
    status, n = F.col("status"), F.col("count")

    def merged(by: list[str]) -> DataFrame:
        aggs = [F.sum(n).alias("total")]
        aggs += [F.sum(F.when(status == s, n).otherwise(0)).alias(s) for s in STATUSES]
        aggs.append(F.sum(F.when(~status.isin(*STATUSES), n).otherwise(0)).alias("other"))
        aggs += [F.sum(c).alias(c) for c in ("attempts", "retries", "retried")]
        aggs += [
            F.try_divide(F.sum("_latency_sum"), F.sum("_sent")).alias("latency_mean"),
            F.max("latency_max").alias("latency_max"),
            F.kll_merge_agg_double("_sketch").alias("_sketch"),
            F.sum("_sent").alias("_sent"),
        ]
        sketch = F.col("_sketch")
        # an empty sketch (no push sent) has no quantile: the function would raise
        quantiles = [
            F.when(F.col("_sent") > 0, F.kll_sketch_get_quantile_double(sketch, F.lit(q)))
            for q in QUANTILES
        ]
        return _finish(fine.groupBy(*by).agg(*aggs).withColumn("_pct", F.array(*quantiles)), by)

    return {
        "summary": merged(keys),
        "reasons": fine.select(*keys, "status", "reason", "count"),
        "hourly": merged(["hour"]),
        "_rows": fine,
    }


def build_tables(receipts: DataFrame, options: Mapping[str, Any]) -> dict[str, DataFrame]:
    """The report's DataFrames from valid receipts (no I/O; useful to other jobs).

    `_rows` is the DataFrame every table is computed from; the job caches it.
    """
    from pyspark.sql import functions as F

    if options["percentiles"] == "sketch":
        if has_sketches():
            return tables_from_fine(fine_rows(receipts, options))
        options = {**options, "percentiles": "approx"}  # Spark < 4.1.2

    rows = receipts.select(
        hour_col(F.col("ts")).alias("hour"),
        *GROUP,
        "status",
        "reason",
        "attempts",
        "latency_ms",
    )
    keys = ["hour", *GROUP]
    summary = _finish(rows.groupBy(*keys).agg(*_count_aggs(), *_latency_aggs(options)), keys)
    hourly = _finish(rows.groupBy("hour").agg(*_count_aggs(), *_latency_aggs(options)), ["hour"])
    reasons = rows.groupBy(*keys, "status", "reason").agg(F.count(F.lit(1)).alias("count"))
    return {"summary": summary, "reasons": reasons, "hourly": hourly, "_rows": rows}


SORT = {
    "summary": ["hour", *GROUP],
    "reasons": ["hour", *GROUP, "status", "reason"],
    "hourly": ["hour"],
}


def aggregation_conf(options: Mapping[str, Any]) -> dict[str, str]:
    """Sketch / percentile aggregates are "object" aggregates, which Spark sorts the input
    for once a task sees more than 128 groups (its default): the finest grain has tens of
    thousands. Keeping them in a hash map is 1.5x faster."""
    return {OBJECT_HASH_GROUPS: str(int(options["hash_groups"]))}


@with_sql_conf(aggregation_conf)
def run(
    spark: SparkSession, receipts_dir: str, out_dir: str, options: Mapping[str, Any]
) -> JobResult:
    from pyspark import StorageLevel

    started = time.monotonic()
    spark.conf.set("spark.sql.session.timeZone", "UTC")

    if options["chart"]:
        render.preload()
    source = read_receipts(spark, receipts_dir, max_reported=int(options["max_bad_lines"]))
    result = JobResult(NAME)
    collected: dict[str, list[dict[str, Any]]] = {}
    _progress(f"reading receipts from {receipts_dir}", started)
    # One pass over the input. With sketches, the finest-grain aggregate (small) is
    # computed once and checkpointed, and every table merges it; otherwise the projected
    # receipts are cached and every table aggregates the cache.
    if options["percentiles"] == "sketch" and has_sketches():
        fine = fine_rows(source.df, options).localCheckpoint(eager=True)
        tables = tables_from_fine(fine)
        rows = tables.pop("_rows")  # the checkpoint: already stored, not cached again
    else:
        tables = build_tables(source.df, options)
        rows = tables.pop("_rows").persist(StorageLevel.MEMORY_AND_DISK)
        rows.count()  # filled now: the tables, written side by side, would each read the input
    result.input = source.stats()
    report_bad_input(result.input)
    _progress("aggregated the receipts", started)
    ensure_dir(spark, out_dir)
    png = None
    try:
        with ThreadPoolExecutor(max_workers=len(SORT), thread_name_prefix=NAME) as pool:
            futures = _write_tables(pool, tables, out_dir, started)
            if options["chart"]:
                hourly = futures["hourly"].result()[1]
                _progress("drawing chart", started)
                png = render.chart_png(hourly)  # while the other tables are written
            for name, future in futures.items():
                paths, collected[name] = future.result()
                result.outputs.update(paths)
    finally:
        rows.unpersist()
    hourly, summary = collected["hourly"], collected["summary"]
    count = sum(int(r["total"]) for r in hourly)
    ok = sum(int(r["ok"]) for r in hourly)
    result.metrics = {
        "receipts": count,
        "ok": ok,
        "success_rate": (ok / count) if count else None,
        "hours": len(hourly),
        "groups": len({(r["plugin"], r["provider"], r["app_id"]) for r in summary}),
    }
    if png is not None:
        result.outputs["chart.png"] = write_bytes(spark, join(out_dir, "chart.png"), png)
        page = render.report_html(hourly, summary, result, png)
        result.outputs["index.html"] = write_bytes(spark, join(out_dir, "index.html"), page)
    else:  # an earlier run's chart and page in this --out would pass for this run's
        for name in ("chart.png", "index.html"):
            remove_file(spark, join(out_dir, name))
    return write_result(spark, out_dir, result, started)


def _write_tables(
    pool: ThreadPoolExecutor, tables: dict[str, DataFrame], out_dir: str, started: float
) -> dict[str, Future[tuple[dict[str, str], list[dict[str, Any]]]]]:
    """Start writing the three tables at once; hourly and summary rows are collected.

    Hourly and summary are one Spark job each (merge and collect; the driver writes
    their files), reasons a few (Parquet, CSV), all small: one after another they left
    cores idle between jobs, side by side they overlap (docs/spark.md).
    """
    from pyspark import inheritable_thread_target

    # the job's local properties and session tags carry over to the writing threads
    @inheritable_thread_target(next(iter(tables.values())).sparkSession)
    def write(name: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
        written = write_table(tables[name], out_dir, name, SORT[name], collect=name != "reasons")
        _progress(f"wrote {name}", started)
        return written

    return {name: pool.submit(write, name) for name in ("hourly", "summary", "reasons")}


def _progress(message: str, started: float) -> None:
    progress(NAME, message, started)


JOB = SparkJob(
    name=NAME,
    description="Per hour x plugin x provider x app: statuses, reasons, success rate, "
    "retries, latency p50/p95/p99; Parquet + CSV + chart + HTML page",
    run=run,
    options=OPTIONS,
    submit_script="delivery_report.py",
)
