"""`dead-tokens`: token hashes to retire, as a file `pushgw tokens retire FILE` feeds back.

A token (identified by plugin, app_id, provider and its keyed `token_hash`; receipts
without a hash, e.g. Marmot's, are never considered) is retired when either:

1. **permanent**: it has a receipt whose status is in `permanent_statuses` (default
   `token_invalid`, the provider saying the token will never work again) and no `ok`
   receipt after the last such one (a later success proves the token alive). Add
   `permanent` to the option to also retire tokens whose pushes were refused as
   malformed, which is usually a gateway or plugin bug, not a dead token. A receipt
   the mass-invalidation guard held (`permanent` / `invalidation_suspended`) never
   retires: the guard suspects a wrong environment or project, not dead tokens; nor
   does one refused for its app's configuration (`BadTopic`, `certificate_expired`,
   ... : the core's `CONFIG_REASONS`), which every token of the app gets alike.
2. **transient streak**: its receipts since its last `ok` include at least
   `transient_failures` (N, default 5) failures with a status in `transient_statuses`
   (default `transient`) that reached the provider (`attempts > 0`; the gateway's own
   refusals such as `queue_full` or `circuit_open` say nothing about the token),
   counting only failures inside the trailing window of `window_hours` (default 168)
   before `now` (default: the newest receipt, with a token hash or not, or the
   current time if that is earlier, so that one receipt from a clock running ahead
   cannot move the window past every real failure), and the streak spans at least
   `min_span_hours` (default 24) from its first to its last failure, so that a short
   provider outage retires nothing. Receipts with other statuses (`auth`, `throttled`)
   neither count nor break a streak.

`now` bounds the streak window only: a permanent failure after `now` still retires, and
an `ok` after `now` still revives (it proves the token alive, whenever it came). An `ok`
at the same `ts` as a failure wins: that failure neither counts nor retires.

Output: `dead-tokens.jsonl` in `--out`, one JSON object per token, sorted by plugin,
app and hash (see docs/spark.md for the exact format):
`{"plugin", "app_id", "provider", "token_hash", "reason", "failures", "last_seen"}`.
`reason` is the provider's reason of the last permanent failure (e.g. `BadDeviceToken`)
or `consecutive_transient_failures`; `failures` the number of failures behind the
decision; `last_seen` the unix time of the token's newest receipt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.core.classify import CONFIG_REASONS
from gateway.core.push import ProviderKind
from spark_plugins.jobs import (
    JAVA_INT_MAX,
    JobOption,
    JobResult,
    OptionError,
    SparkJob,
    progress,
    with_sql_conf,
)
from spark_plugins.output import ensure_dir, join, write_result, write_single
from spark_plugins.reader import (
    MAX_BAD_LINES,
    STATUSES,
    TS_MAX,
    observed_metrics,
    read_receipts,
    report_bad_input,
)
from spark_plugins.session import BYPASS_PARTIAL_AGGREGATION, OBJECT_HASH_GROUPS

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

NAME = "dead-tokens"
FILE = "dead-tokens.jsonl"
STREAK_REASON = "consecutive_transient_failures"
HELD_REASON = "invalidation_suspended"  # gateway.core.push.Reason.INVALIDATION_SUSPENDED
# Refusals that say nothing of the token: the guard's hold (above) and an app's
# configuration refused (a wrong topic, an expired or refused certificate, a wrong
# project): every token of the app gets them, and retiring on them would delete them all.
NOT_THE_TOKEN = (HELD_REASON, *sorted(CONFIG_REASONS))
FIELDS = ("plugin", "app_id", "provider", "token_hash", "reason", "failures", "last_seen")

# what a status option may name: the documented statuses, except the success (an `ok`
# receipt is what ends a failure streak and revives a token)
FAILURE_STATUSES = tuple(s for s in STATUSES if s != "ok")

OPTIONS = (
    JobOption(
        "permanent_statuses",
        tuple,
        ("token_invalid",),
        "statuses that retire at once",
        choices=FAILURE_STATUSES,
    ),
    JobOption(
        "transient_statuses",
        tuple,
        ("transient",),
        "statuses counted in a streak",
        choices=FAILURE_STATUSES,
    ),
    JobOption(
        "transient_failures",
        int,
        5,
        "N: consecutive transient failures that retire",
        minimum=1,
        maximum=JAVA_INT_MAX,
    ),
    JobOption(
        "window_hours",
        float,
        168.0,
        "streak failures counted in this trailing window",
        exclusive_minimum=0,
    ),
    JobOption("min_span_hours", float, 24.0, "a streak must span at least this long", minimum=0),
    JobOption(
        "now",
        float,
        None,
        "end of the window, unix seconds (default: newest receipt, or now if earlier)",
        minimum=0,
        maximum=TS_MAX,  # receipts' range
    ),
    MAX_BAD_LINES,
    JobOption(
        "hash_groups",
        int,
        200_000,
        "tokens a task aggregates in memory before sorting (objectHashAggregate fallback)",
        minimum=1,
        maximum=JAVA_INT_MAX,
    ),
)


def check_options(options: Mapping[str, Any]) -> None:
    """A streak lies inside the window: one that must span longer could never retire."""
    span, window = float(options["min_span_hours"]), float(options["window_hours"])
    if span > window:
        raise OptionError(
            f"min_span_hours ({span:g}) is longer than window_hours ({window:g}): "
            "no streak could retire a token"
        )


KEYS = ("plugin", "app_id", "provider", "token_hash")


def per_token(receipts: DataFrame, options: Mapping[str, Any]) -> DataFrame:
    """One row per token with the facts the decision needs (no window applied yet)."""
    from pyspark.sql import functions as F

    status = F.col("status")
    # A push the mass-invalidation guard held (`permanent` / `invalidation_suspended`)
    # got a token-invalid answer while most of its app's tokens did: a wrong environment
    # or project, not a dead token. The guard exists so that nothing deletes those
    # tokens; retiring them here would, once `permanent` is among the statuses. The
    # same for a push refused for its app's configuration (`NOT_THE_TOKEN`).
    held = F.coalesce(F.col("reason").isin(*NOT_THE_TOKEN), F.lit(False))
    perm = status.isin(*options["permanent_statuses"]) & ~held
    transient = status.isin(*options["transient_statuses"]) & (F.col("attempts") > 0)
    return (
        receipts.filter(F.col("token_hash").isNotNull())
        .groupBy(*KEYS)
        .agg(
            F.max("ts").alias("last_seen"),
            F.max(F.when(status == "ok", F.col("ts"))).alias("last_ok"),
            # the newest permanent failure and its reason (struct order: ts first)
            F.max(F.when(perm, F.struct("ts", F.coalesce("reason", "status").alias("r")))).alias(
                "last_perm"
            ),
            F.collect_list(F.when(perm, F.col("ts"))).alias("perm_ts"),
            F.collect_list(F.when(transient, F.col("ts"))).alias("fail_ts"),
        )
    )


def decide(tokens: DataFrame, end: float, options: Mapping[str, Any]) -> DataFrame:
    """The tokens to retire, in the dead-token file's columns."""
    from pyspark.sql import functions as F

    cutoff = end - float(options["window_hours"]) * 3600
    since_ok = F.coalesce(F.col("last_ok"), F.lit(float("-inf")))
    streak = F.filter(
        "fail_ts", lambda t: (t > since_ok) & (t >= F.lit(cutoff)) & (t <= F.lit(end))
    )
    perms = F.filter("perm_ts", lambda t: t > since_ok)
    with_facts = tokens.select(
        *KEYS,
        "last_seen",
        F.col("last_perm.ts").alias("perm_at"),
        F.col("last_perm.r").alias("perm_reason"),
        since_ok.alias("since_ok"),
        F.size(perms).alias("perm_n"),
        F.size(streak).alias("streak_n"),
        (F.array_max(streak) - F.array_min(streak)).alias("streak_span"),
    )
    permanent = F.col("perm_at").isNotNull() & (F.col("perm_at") > F.col("since_ok"))
    streaky = (F.col("streak_n") >= int(options["transient_failures"])) & (
        F.col("streak_span") >= float(options["min_span_hours"]) * 3600
    )
    return (
        with_facts.filter(permanent | streaky)
        .select(
            *KEYS,
            # a provider's reason as written, but a control character as a space
            F.when(permanent, F.regexp_replace(F.col("perm_reason"), CONTROL, " "))
            .otherwise(F.lit(STREAK_REASON))
            .alias("reason"),
            F.when(permanent, F.col("perm_n")).otherwise(F.col("streak_n")).alias("failures"),
            F.col("last_seen").cast("decimal(20,6)").alias("last_seen"),
        )
        .select(*FIELDS)
    )


SORT = ["plugin", "app_id", "token_hash", "provider"]

# What `pushgw tokens retire` accepts on a line (gateway.dead_tokens.DeadToken). Receipts
# are semi-trusted input: a forged or damaged one may name a token with a hash that is
# no HMAC-SHA256, an empty plugin or app, control characters, an unknown provider. Such
# a token is counted (`tokens_not_retirable`), not written: the command refuses a whole
# file for one line it cannot take, and would then retire nothing.
PROVIDERS = tuple(kind.value for kind in ProviderKind)
CONTROL = "\\p{Cntrl}"  # Java regex: [\x00-\x1f\x7f], what DeadToken's text refuses


def retirable() -> Column:
    """True for a row of `decide` that `pushgw tokens retire` accepts."""
    from pyspark.sql import functions as F

    def text(name: str) -> Column:
        value = F.col(name)
        return (F.length(value) > 0) & ~value.rlike(CONTROL)

    provider = F.col("provider")
    hash_like = F.col("token_hash").rlike("^[0-9a-f]{64}\\z")  # \z, not $: no final newline
    return (
        text("plugin")
        & text("app_id")
        & hash_like
        & (provider.isNull() | provider.isin(*PROVIDERS))
    )


def default_window_end(newest: float | None, wall_clock: float) -> float:
    """The window's end when option `now` is not given: the newest receipt, but never
    later than the current time (a gateway clock running ahead moves no window)."""
    return wall_clock if newest is None else min(newest, wall_clock)


def aggregation_conf(options: Mapping[str, Any]) -> dict[str, str]:
    """How Spark should run `per_token`'s aggregation.

    Its lists make it an "object" aggregate, which Spark sorts the input for once a task
    holds more than 128 tokens; a map of up to `hash_groups` tokens avoids that sort.
    And a token has only a few receipts in any one input split, so the partial
    aggregation before the shuffle builds a map as large as its input and shrinks
    nothing; the job skips it (Spark 4.3+). Even with 500 receipts per token, keeping
    it was no faster. Figures: docs/spark.md (`bench/spark_dead_tokens.py`).
    """
    return {
        OBJECT_HASH_GROUPS: str(int(options["hash_groups"])),
        BYPASS_PARTIAL_AGGREGATION: "true",
    }


@with_sql_conf(aggregation_conf)
def run(
    spark: SparkSession, receipts_dir: str, out_dir: str, options: Mapping[str, Any]
) -> JobResult:
    from pyspark import StorageLevel
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    started = time.monotonic()
    source = read_receipts(spark, receipts_dir, max_reported=int(options["max_bad_lines"]))
    # The newest receipt ends the default window, whether it has a token hash or not
    # (Marmot's have none, and `per_token` leaves them out): observed on the same pass.
    newest_seen = Observation("pushgw_dead_tokens_newest")
    receipts = source.df.observe(newest_seen, F.max("ts").alias("newest"))
    tokens = per_token(receipts, options).persist(StorageLevel.MEMORY_AND_DISK)
    result = JobResult(NAME)
    try:
        progress(NAME, f"reading receipts from {receipts_dir}", started)
        tokens_seen = tokens.count()
        result.input = source.stats()
        report_bad_input(result.input)
        end = options["now"]
        if end is None:
            newest = observed_metrics(newest_seen).get("newest")  # {} when no row was read
            newest_ts = float(newest) if newest is not None else None
            end = default_window_end(newest_ts, time.time())
        dead = decide(tokens, float(end), options).persist(StorageLevel.MEMORY_AND_DISK)
        ensure_dir(spark, out_dir)
        path = write_single(
            dead.filter(retirable()).coalesce(1).sortWithinPartitions(*SORT),
            join(out_dir, FILE),
            "json",
            {"ignoreNullFields": "false"},
        )
        counts = (
            dead.groupBy("reason", retirable().alias("ok"))
            .agg(F.count(F.lit(1)).alias("n"))
            .collect()
        )
        by_reason: dict[str, int] = {}
        not_retirable = 0
        for row in counts:
            if row["ok"]:
                by_reason[row["reason"]] = by_reason.get(row["reason"], 0) + row["n"]
            else:
                not_retirable += row["n"]
        dead.unpersist()
    finally:
        tokens.unpersist()
    result.outputs[FILE] = path
    result.metrics = {
        "tokens_seen": tokens_seen,
        "tokens_retired": sum(by_reason.values()),
        "by_reason": by_reason,
        "tokens_not_retirable": not_retirable,
        "window_end": end,
    }
    return write_result(spark, out_dir, result, started)


JOB = SparkJob(
    name=NAME,
    description="Token hashes to retire (permanent failure, or N consecutive transient "
    "failures over a window) as dead-tokens.jsonl for `pushgw tokens retire`",
    run=run,
    options=OPTIONS,
    submit_script="dead_tokens.py",
    check=check_options,
)
