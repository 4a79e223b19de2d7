"""What a run of the suite (and a gateway in production) leaves behind in $TMPDIR."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import yaml

from tests.serve_process import finish, free_port, running_pids, spawn_serve


async def test_workers_of_a_killed_parent_remove_the_metrics_directory(tmp_path: Path) -> None:
    """`pushgw serve --workers N` keeps its workers' metrics in a `pushgw-metrics-*`
    directory of $TMPDIR, removed by the parent when it ends. A parent killed outright
    (the OOM killer, `kill -9`) removed nothing: its workers stopped, but every such kill
    left the directory and the workers' files behind (one per kill, in CI's /tmp too).
    Now the orphaned workers remove their own files and the last one the directory."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"port": free_port(), "workers": 2, "shutdown_timeout": 1},
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {"directory": str(tmp_path / "receipts")},
            }
        )
    )
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    env.pop("PUSHGW_CONFIG", None)
    proc = await spawn_serve(config, env)
    seen: list[str] = []
    try:
        await running_pids(proc, seen, 2)
        [directory] = tmpdir.glob("pushgw-metrics-*")  # where the workers keep their metrics
        assert any(directory.iterdir())
        proc.send_signal(signal.SIGKILL)
        status = await finish(proc, seen)  # stderr ends once every worker has exited
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert status == -signal.SIGKILL
    assert not directory.exists(), sorted(p.name for p in directory.iterdir())
    assert list(tmpdir.iterdir()) == []
    assert "Traceback" not in "".join(seen)
