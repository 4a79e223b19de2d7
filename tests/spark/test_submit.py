"""A job run through `spark-submit` of its plain entry script (a separate JVM: slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spark_plugins import synthetic
from spark_plugins.session import spark_problem
from spark_plugins.testing import spark_submit_binary

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _submit(
    script: str, tmp_path: Path, *args: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """spark-submit `script` over 500 receipts from the real writer; (process, out dir)."""
    problem = spark_problem()
    if problem:
        pytest.skip(f"needs pyspark and Java 17: {problem}")
    submit = spark_submit_binary()
    from spark_plugins.submit import DIR

    receipts = tmp_path / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(500, seed=11, tokens=20)), receipts)
    out = tmp_path / "out"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    command = [submit, "--master", "local[1]", "--conf", "spark.ui.enabled=false"]
    command += [f"{DIR}/{script}", *args, "--receipts", str(receipts), "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


def test_dead_tokens_through_spark_submit(tmp_path: Path) -> None:
    proc, out = _submit("dead_tokens.py", tmp_path, "--option", "min_span_hours=0")
    assert "dead-tokens: 500 receipts" in proc.stdout
    entries = [json.loads(x) for x in (out / "dead-tokens.jsonl").read_text().splitlines()]
    assert entries and all(e["token_hash"] for e in entries)
