"""Testing helpers for Spark job authors: a real Spark standalone cluster on this machine.

Local mode runs everything in the driver's JVM, so it cannot show what only a cluster
does: executors in their own JVMs, in their own working directories, with no Python
(the jobs must not need Python UDFs), and paths resolved by the driver. To check a job
against that before an operator does, start a standalone master and one worker from the
installed pyspark (no other Spark install is needed) and `spark-submit` to it:

    from spark_plugins.testing import spark_submit_binary, standalone_cluster

    with standalone_cluster(cores=2, memory="1g") as cluster:
        subprocess.run([spark_submit_binary(), "--master", cluster.master_url,
                        "--conf", f"spark.pyspark.driver.python={sys.executable}",
                        f"{spark_plugins.submit.DIR}/run_job.py", "my-job",
                        "--receipts", "receipts", "--out", "out"], check=True)
        assert cluster.executors_launched >= 1

Both daemons bind 127.0.0.1 on free ports and are stopped when the block ends. Needs
pyspark and Java 17 (`spark_plugins.session.spark_problem()` says what is missing).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_MASTER_READY = re.compile(r"Starting Spark master at (spark://\S+)")
_WORKER_READY = re.compile(r"Successfully registered with master")
_EXECUTOR_LAUNCHED = re.compile(r"Asked to launch executor")
STARTUP_TIMEOUT = 120.0  # seconds; a cold JVM on a busy 2-core machine takes ~5


def spark_home() -> str:
    """`SPARK_HOME`, or the installed pyspark package (it ships Spark's jars and scripts)."""
    home = os.environ.get("SPARK_HOME")
    if home:
        return home
    import pyspark

    return str(Path(pyspark.__file__).resolve().parent)


def spark_submit_binary() -> str:
    """Spark's own `spark-submit` (in `spark_home()`). Unlike the wrapper pip puts next
    to the Python executable, which looks for pyspark with whatever `python3` is on PATH,
    it finds its Spark from where it lies, so callers need no `SPARK_HOME`."""
    return str(Path(spark_home()) / "bin" / "spark-submit")


class _Daemon:
    """One Spark daemon JVM whose merged log is read by a thread (so its pipe never
    fills) and kept, the last lines for error messages, and matched for readiness."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        self.tail: deque[str] = deque(maxlen=200)
        self.executors_launched = 0  # a worker's "Asked to launch executor" lines
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"spark-{name}-log", daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.tail.append(line.rstrip("\n"))
            if _EXECUTOR_LAUNCHED.search(line):
                self.executors_launched += 1
            self._lines.put(line)
        self._lines.put(None)  # end of output: the process exited

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """The first log line matching `pattern`; raises if the daemon exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(self._failure(f"not ready after {timeout:.0f}s"))
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(self._failure("exited before it was ready"))
            match = pattern.search(line)
            if match:
                return match

    def _failure(self, what: str) -> str:
        log = "\n".join(list(self.tail)[-30:])
        return f"Spark {self.name} {what}; its last log lines:\n{log}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class StandaloneCluster:
    """A running standalone master with one registered worker."""

    master_url: str
    work_dir: Path
    _worker: _Daemon = field(repr=False)

    @property
    def executors_launched(self) -> int:
        """Executors the worker was asked to launch so far (one per application)."""
        return self._worker.executors_launched

    def worker_log(self) -> list[str]:
        """The worker's last log lines (up to 200)."""
        return list(self._worker.tail)


@contextmanager
def standalone_cluster(
    *, cores: int = 2, memory: str = "1g", work_dir: str | Path | None = None
) -> Iterator[StandaloneCluster]:
    """Start a standalone master and one worker (`cores`, `memory` for its executors) on
    127.0.0.1; yield once the worker has registered; stop both on exit.

    `work_dir` holds the executors' working directories and logs (a temporary directory
    by default, removed afterwards).
    """
    import tempfile

    home = spark_home()
    spark_class = str(Path(home) / "bin" / "spark-class")
    env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1")
    owned = work_dir is None
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="spark-work-"))
    work.mkdir(parents=True, exist_ok=True)
    daemons: list[_Daemon] = []
    try:
        master = _Daemon(
            "master",
            [spark_class, MASTER_CLASS, "--host", "127.0.0.1", "--port", "0", "--webui-port", "0"],
            env,
        )
        daemons.append(master)
        url = master.wait_for(_MASTER_READY, STARTUP_TIMEOUT).group(1)
        worker = _Daemon(
            "worker",
            [
                *(spark_class, WORKER_CLASS, "--host", "127.0.0.1", "--port", "0"),
                *("--webui-port", "0", "--cores", str(cores), "--memory", memory),
                *("--work-dir", str(work), url),
            ],
            env,
        )
        daemons.append(worker)
        worker.wait_for(_WORKER_READY, STARTUP_TIMEOUT)
        yield StandaloneCluster(url, work, worker)
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
        if owned:
            shutil.rmtree(work, ignore_errors=True)
