"""`spark_plugins.testing.standalone_cluster` against a stand-in `spark-class` (no Java):
readiness is read from the daemons' logs, a daemon that dies is reported with its log,
and both are stopped afterwards. The real cluster is exercised by test_cluster.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from spark_plugins.testing import standalone_cluster

# $1 is the daemon class; the worker's last argument is the master URL. The worker's
# executor line comes before its readiness line: the log is read line by line, so it is
# counted before the cluster is yielded (after it, the count would race the test).
FAKE_SPARK_CLASS = """#!/bin/sh
echo "$@" >> "$SPARK_HOME/calls"
echo $$ >> "$SPARK_HOME/pids"
case "$1" in
  *Master) echo "INFO Master: Starting Spark master at spark://127.0.0.1:7099" ;;
  *Worker)
    if [ -n "$FAIL_WORKER" ]; then echo "ERROR Worker: cannot bind port" >&2; exit 1; fi
    echo "INFO Worker: Asked to launch executor app-1/0 for fake"
    echo "INFO Worker: Successfully registered with master spark://127.0.0.1:7099" ;;
esac
exec sleep 600
"""


@pytest.fixture
def fake_spark_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "bin" / "spark-class"
    script.parent.mkdir()
    script.write_text(FAKE_SPARK_CLASS)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path))
    return tmp_path


def _running(home: Path) -> list[int]:
    """The fake daemons (their shell becomes `sleep`: same pid) still running."""
    alive = []
    for pid in map(int, (home / "pids").read_text().split()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def test_cluster_is_ready_when_the_worker_has_registered(fake_spark_home: Path) -> None:
    with standalone_cluster(cores=3, memory="512m") as cluster:
        assert cluster.master_url == "spark://127.0.0.1:7099"
        assert cluster.executors_launched == 1
        assert any("Successfully registered" in line for line in cluster.worker_log())
        work_dir = cluster.work_dir
        assert work_dir.is_dir()
        assert len(_running(fake_spark_home)) == 2
    assert not _running(fake_spark_home)
    assert not work_dir.exists()  # a work dir the helper made is removed
    master_call, worker_call = (fake_spark_home / "calls").read_text().splitlines()
    assert master_call.endswith("Master --host 127.0.0.1 --port 0 --webui-port 0")
    assert "--cores 3 --memory 512m" in worker_call
    assert worker_call.endswith("spark://127.0.0.1:7099")


def test_a_daemon_that_dies_is_reported_with_its_log(
    fake_spark_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAIL_WORKER", "1")
    work = tmp_path / "work"
    with pytest.raises(RuntimeError) as failure, standalone_cluster(work_dir=work):
        pytest.fail("the cluster must not be yielded")
    assert not _running(fake_spark_home)  # the master is stopped too
    message = str(failure.value)
    assert "Spark worker exited before it was ready" in message
    assert "cannot bind port" in message
    assert work.is_dir()  # a work dir the caller gave is left in place
