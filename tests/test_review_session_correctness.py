"""A second pair of eyes on one day's changes: where two of them meet.

- The spark-submit entry scripts (`submit_main`) and Ctrl-C: `run_jobs` names the job it
  left incomplete in one line and lets the interrupt go on, for `pushgw spark run` to
  end 130; the entry scripts let it go on too, so a traceback followed that line and
  Python, not the script, chose the status.
- `server.metrics_host` (for Sygnal's `metrics.prometheus.address`) without
  `server.metrics_port`: ignored without a word, /metrics stayed on the public main port
  while the operator meant it on loopback or a private interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main as pushgw
from spark_plugins import SparkJob, runner, synthetic
from spark_plugins.session import spark_problem


def _check_config(tmp_path: Path, server: dict[str, Any]) -> Path:
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump({"server": server}))
    return path


def test_metrics_host_without_metrics_port_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _check_config(tmp_path, {"host": "0.0.0.0", "metrics_host": "127.0.0.1"})
    assert pushgw(["check-config", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "server: metrics_host is the address of metrics_port, which is not set" in err
    assert "set metrics_port too, or remove metrics_host" in err


def test_metrics_host_with_metrics_port_is_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = {"host": "0.0.0.0", "metrics_port": 9109, "metrics_host": "127.0.0.1"}
    assert pushgw(["check-config", "-c", str(_check_config(tmp_path, server))]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)  # JSON, which YAML reads
    assert printed["server"]["metrics_host"] == "127.0.0.1"
    assert printed["server"]["metrics_port"] == 9109


@pytest.mark.spark
def test_spark_submit_entry_ctrl_c_is_one_line_and_status_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = spark_problem()
    if problem:
        pytest.skip(f"needs pyspark and Java 17: {problem}")
    receipts = tmp_path / "r"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(20, seed=2, tokens=5)), receipts)
    out = tmp_path / "out"
    out.mkdir()
    (out / "result-per-app.json").write_text("{}")  # an earlier run's marker

    def run(spark: Any, receipts_dir: str, out_dir: str, options: Any) -> Any:
        (Path(out_dir) / "per-app.csv").write_text("app_id,count\n")
        raise KeyboardInterrupt  # what pyspark's SIGINT handler raises in the driver

    def never(spark: Any, receipts_dir: str, out_dir: str, options: Any) -> Any:
        raise AssertionError("a job after the interrupted one ran")

    jobs = {
        "per-app": SparkJob("per-app", "x", run, ()),
        "later": SparkJob("later", "y", never, ()),
    }
    monkeypatch.setattr(runner, "discover_jobs", lambda: jobs)
    argv = ["per-app", "later", "--receipts", str(receipts), "--out", str(out)]
    status = runner.submit_main(None, argv)  # raised KeyboardInterrupt before the fix

    assert status == 130
    err = capsys.readouterr().err
    assert err.endswith(
        f"pushgw spark: interrupted during per-app: its outputs in {out} are not a complete "
        "run (no result-per-app.json); not run: later\n"
    )
    assert "Traceback" not in err
    assert not (out / "result-per-app.json").exists()
