"""pushgw in a hardened pod: read-only root file system and install, an arbitrary user id
with no passwd entry, HOME read-only, only the state directory writable, no TTY.

Simulated with Linux namespaces (util-linux `unshare`): a mount namespace makes the
install, /tmp and /var/tmp read-only (the test's state directory stays writable), and a
nested user namespace runs the command as uid 12345, which has no /etc/passwd entry,
under `env -i`. A passwd entry, when a test wants one, is a file bind-mounted over
/etc/passwd in that namespace only. Skipped where user namespaces are not allowed.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import pytest

import gateway
from spark_plugins import synthetic
from spark_plugins.session import java_problem, pyspark_problem

UID = 12345
REPO = Path(gateway.__file__).resolve().parents[1]
PUSHGW = str(Path(sys.executable).parent / "pushgw")
READ_ONLY = [str(REPO), sys.base_prefix, sys.prefix, "/tmp", "/var/tmp"]


@cache
def _sandbox_problem() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(
        ["unshare", "-Urm", "unshare", "--user", f"--map-user={UID}", "true"],
        capture_output=True,
        check=False,
    )
    return None if probe.returncode == 0 else "user namespaces are not allowed here"


def _sandboxed(
    argv: Sequence[str],
    *,
    state: Path,
    cwd: Path,
    home: Path,
    env: dict[str, str] | None = None,
    passwd: Path | None = None,
) -> list[str]:
    """`argv` as run in the hardened pod; `state` is the only writable directory."""
    problem = _sandbox_problem()
    if problem:
        pytest.skip(problem)
    mounts = [f'mount --bind "{state}" "{state}"']
    mounts += [f'mount --rbind "{p}" "{p}" && mount -o remount,bind,ro "{p}"' for p in READ_ONLY]
    if passwd is not None:
        mounts.append(f'mount --bind "{passwd}" /etc/passwd')
    script = " && ".join(
        [*mounts, f'cd "{cwd}"', f'exec unshare --user --map-user={UID} --map-group={UID} "$@"']
    )
    variables = {"HOME": str(home), "PATH": "/usr/bin:/bin", **(env or {})}
    return [
        "unshare",
        "-Urm",
        "bash",
        "-c",
        script,
        "sandbox",
        "env",
        "-i",
        *[f"{k}={v}" for k, v in variables.items()],
        *argv,
    ]


class Pod:
    def __init__(self, tmp_path: Path) -> None:
        self.state = tmp_path / "state"
        self.state.mkdir()
        self.readonly = tmp_path / "readonly"  # HOME and working directory
        self.readonly.mkdir()
        self.readonly.chmod(0o555)
        self.config = self.state / "pushgw.yaml"
        self.config.write_text(
            f"store:\n  url: sqlite+aiosqlite:///{self.state}/pushgw.db\n"
            f"receipts:\n  directory: {self.state}/receipts\n"
        )

    def passwd(self) -> Path:
        """The host's passwd plus an entry for UID (home /nonexistent, as k8s helpers do)."""
        path = self.state / "passwd"
        host = Path("/etc/passwd").read_text()
        path.write_text(host + f"pushgw:x:{UID}:{UID}:pushgw:/nonexistent:/bin/false\n")
        return path

    def run(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        passwd: bool = False,
        timeout: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        cmd = _sandboxed(
            [PUSHGW, *args],
            state=self.state,
            cwd=self.readonly,
            home=self.readonly,
            env=env,
            passwd=self.passwd() if passwd else None,
        )
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )


@pytest.fixture
def pod(tmp_path: Path) -> Pod:
    return Pod(tmp_path)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr
    assert len(lines) == 1, stderr
    return lines[0]


# -- the core's commands -----------------------------------------------------------------


def test_core_commands_work_with_no_passwd_entry_and_a_read_only_root(pod: Pod) -> None:
    checked = pod.run("check-config", "-c", str(pod.config))
    assert checked.returncode == 0, checked.stderr
    upgraded = pod.run("db", "upgrade", "-c", str(pod.config))
    assert upgraded.returncode == 0, upgraded.stderr
    assert "database at head" in upgraded.stdout
    dead = pod.state / "dead.jsonl"
    dead.write_text('{"plugin": "zulip", "app_id": "a", "token_hash": "' + "a" * 64 + '"}\n')
    retired = pod.run("tokens", "retire", "-c", str(pod.config), str(dead))
    assert retired.returncode == 0, retired.stderr
    synthetic.write_with_receipt_writer(list(synthetic.receipts(5)), pod.state / "receipts")
    cat = pod.run("receipts", "cat", "-c", str(pod.config))
    assert cat.returncode == 0, cat.stderr
    assert len(cat.stdout.splitlines()) == 5


def test_serve_runs_and_stops_with_no_passwd_entry_and_a_read_only_root(pod: Pod) -> None:
    cmd = _sandboxed(
        [PUSHGW, "serve", "-c", str(pod.config), "--port", "0"],
        state=pod.state,
        cwd=pod.readonly,
        home=pod.readonly,
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the gateway says on stderr when it listens
            seen.append(line)
            if "Running on" in line:
                break
        assert any("Running on" in line for line in seen), seen
        proc.send_signal(signal.SIGTERM)  # every unshare/env execs: this is pushgw itself
        _, rest = proc.communicate(timeout=60)
        stderr = "".join(seen) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr


def test_serve_workers_without_a_writable_temporary_directory_is_one_line(pod: Pod) -> None:
    proc = pod.run("serve", "-c", str(pod.config), "--workers", "2", timeout=120)
    assert proc.returncode == 2
    assert "TMPDIR" in _one_line(proc.stderr)


# -- pushgw spark run --------------------------------------------------------------------


@pytest.fixture
def receipts(pod: Pod) -> Path:
    directory = pod.state / "receipts"
    synthetic.write_with_receipt_writer(list(synthetic.receipts(300)), directory)
    return directory


def _needs_spark() -> None:
    problem = pyspark_problem() or java_problem()
    if problem:
        pytest.skip(problem)


@pytest.mark.spark
def test_spark_run_without_a_passwd_entry_says_what_to_do(pod: Pod, receipts: Path) -> None:
    """Hadoop's login fails with "Invalid UID" inside Spark, and HADOOP_USER_NAME does not
    help: before, the job failed after the JVM started, as a plugin bug (status 1)."""
    _needs_spark()
    tmp = pod.state / "tmp"
    tmp.mkdir()
    out = pod.state / "out"
    proc = pod.run(
        "spark",
        "run",
        "delivery-report",
        "--receipts",
        str(receipts),
        "--out",
        str(out),
        env={"TMPDIR": str(tmp), "HADOOP_USER_NAME": "pushgw"},
    )
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith("pushgw spark: cannot run delivery-report: user id 12345 has no entry")
    assert "nss_wrapper" in line
    assert not out.exists()


@pytest.mark.spark
def test_spark_run_without_a_writable_temporary_directory_says_set_tmpdir(
    pod: Pod, receipts: Path
) -> None:
    """Before: pyspark's `tempfile.mkdtemp()` raised, told as a plugin bug (status 1)."""
    _needs_spark()
    out = pod.state / "out"
    proc = pod.run(
        "spark",
        "run",
        "delivery-report",
        "--receipts",
        str(receipts),
        "--out",
        str(out),
        passwd=True,
    )
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith("pushgw spark: cannot run delivery-report: no writable temporary")
    assert line.endswith("set TMPDIR to one")


@pytest.mark.spark
def test_spark_run_in_the_hardened_pod_with_tmpdir_writes_the_report(
    pod: Pod, receipts: Path
) -> None:
    """With a passwd entry and TMPDIR the jobs run: the JVM's temporary files go to TMPDIR
    (Java itself ignores it and used the read-only /tmp), and matplotlib does not warn
    about the read-only HOME."""
    _needs_spark()
    tmp = pod.state / "tmp dir"  # a space: the JVM option is quoted
    tmp.mkdir()
    out = pod.state / "out"
    proc = pod.run(
        "spark",
        "run",
        "delivery-report",
        "dead-tokens",
        "--receipts",
        str(receipts),
        "--out",
        str(out),
        "--master",
        "local[1]",
        "--conf",
        "spark.ui.showConsoleProgress=false",
        "--conf",
        "spark.driver.memory=1g",
        env={"TMPDIR": str(tmp)},
        passwd=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "index.html").is_file() and (out / "chart.png").is_file()
    assert (out / "dead-tokens.jsonl").is_file()
    assert "Read-only file system" not in proc.stderr
    assert "matplotlib" not in proc.stderr.lower(), proc.stderr
    assert not list(tmp.glob("pushgw-matplotlib-*"))  # ours, removed at exit
