"""Plain entry scripts for `spark-submit` (one per built-in job, plus `run_job.py`).

    spark-submit --master spark://host:7077 \
        "$(python -c 'import spark_plugins.submit as s; print(s.DIR)')/delivery_report.py" \
        --receipts hdfs:///pushgw/receipts --out hdfs:///pushgw/reports/2025-01-01

The driver needs pushgw importable (installed, or the scripts find the source tree
next to them); executors need only pyspark: the jobs use no Python UDFs.
"""

from pathlib import Path

DIR = str(Path(__file__).resolve().parent)
