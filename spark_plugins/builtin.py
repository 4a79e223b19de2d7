"""The three built-in Spark jobs (no pyspark import here)."""

from __future__ import annotations

from spark_plugins import dead_tokens, delivery_report, volume_anomalies
from spark_plugins.jobs import SparkJob

BUILTIN_JOBS: tuple[SparkJob, ...] = (
    delivery_report.JOB,
    dead_tokens.JOB,
    volume_anomalies.JOB,
)
