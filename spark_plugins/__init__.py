"""PySpark jobs over delivery receipts (docs/spark.md).

Importing this package never imports pyspark: jobs are listed and their options
parsed without it; pyspark (the `pushgw[spark]` extra) and Java 17 are needed only to
run one. Third-party plugins contribute jobs by returning `SparkJob` objects from
their `pushgw_spark_jobs` hook.
"""

from spark_plugins.jobs import (
    BadLine,
    InputStats,
    JobOption,
    JobResult,
    OptionError,
    SparkJob,
    progress,
)

__all__ = ["BadLine", "InputStats", "JobOption", "JobResult", "OptionError", "SparkJob", "progress"]
