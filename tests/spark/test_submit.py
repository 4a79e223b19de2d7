"""A job run through `spark-submit` of its plain entry script (a separate JVM: slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spark_plugins import synthetic
from spark_plugins.session import spark_problem

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _spark_submit() -> str | None:
    local = Path(sys.executable).parent / "spark-submit"
    return str(local) if local.exists() else shutil.which("spark-submit")


def test_dead_tokens_through_spark_submit(tmp_path: Path) -> None:
    problem = spark_problem()
    submit = _spark_submit()
    if problem or submit is None:
        pytest.skip(f"needs pyspark, Java 17 and spark-submit: {problem or 'no spark-submit'}")
    from spark_plugins.submit import DIR

    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(500, seed=11, tokens=20)), receipts)
    out = tmp_path / "out"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    proc = subprocess.run(
        [
            submit,
            "--master",
            "local[1]",
            "--conf",
            "spark.ui.enabled=false",
            f"{DIR}/dead_tokens.py",
            "--receipts",
            str(receipts),
            "--out",
            str(out),
            "--option",
            "min_span_hours=0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dead-tokens: 500 receipts" in proc.stdout
    entries = [json.loads(x) for x in (out / "dead-tokens.jsonl").read_text().splitlines()]
    assert entries and all(e["token_hash"] for e in entries)
