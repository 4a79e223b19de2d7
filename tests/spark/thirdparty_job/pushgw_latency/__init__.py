"""A third-party Spark job in its own distribution, written from docs/spark.md only
("Writing a job"): per reason, the count and a latency quantile, as CSV.

Installed by tests/spark/test_review_thirdparty_job.py as the distribution
`pushgw-latency` (entry point `latency` in `pushgw.plugins`).
"""

from gateway.api import hookimpl
from spark_plugins import JobOption, JobResult, SparkJob
from spark_plugins.jobs import JAVA_INT_MAX
from spark_plugins.reader import read_receipts

NAME = "latency-by-reason"


def run(spark, receipts_dir, out_dir, options):
    from pyspark.sql import functions as F

    source = read_receipts(spark, receipts_dir)
    df = source.df.filter(F.col("attempts") >= 1) if options["sent_only"] else source.df
    per_reason = (
        df.groupBy(F.coalesce("reason", F.lit("")).alias("reason"))
        .agg(
            F.count(F.lit(1)).alias("count"),
            F.percentile_approx("latency_ms", options["quantile"]).alias("latency_p"),
        )
        .orderBy(F.desc("count"), "reason")
        .limit(options["top"])
    )
    path = out_dir + "/latency-by-reason"
    per_reason.coalesce(1).write.mode("overwrite").option("header", "true").csv(path)
    result = JobResult(NAME, outputs={"latency-by-reason": path})
    result.input = source.stats()
    result.metrics = {"reasons": per_reason.count()}
    return result


OPTIONS = (
    JobOption("top", int, 50, "reasons listed", minimum=1, maximum=JAVA_INT_MAX),
    JobOption("quantile", float, 0.95, "latency quantile", exclusive_minimum=0, maximum=1),
    JobOption("sent_only", bool, True, "only pushes that reached a provider"),
)


@hookimpl
def pushgw_spark_jobs():
    return [SparkJob(NAME, "per reason: count and p95 latency, CSV", run, OPTIONS)]
