"""`pushgw serve`: one process, or N worker processes sharing the port (SO_REUSEPORT).

With several workers, each is a fresh interpreter (spawned, not forked) so that
prometheus-client starts in multi-process mode and `/metrics` on any worker reports
the sum over all of them. Migrations run once, in the parent, before workers start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.context import WORKER_ENV
from gateway.core.metrics import MULTIPROC_ENV

if TYPE_CHECKING:
    from gateway.app import LoadedGateway

SIMULATOR_READY_FILE = "ready.json"


def serve(
    *,
    config: str | None,
    data: dict[str, Any] | None,
    host: str | None,
    port: int | None,
    workers: int | None,
    with_simulators: Path | None = None,
) -> int:
    simulators = _start_simulators(with_simulators) if with_simulators else None
    try:
        return _serve(config, data, host, port, workers)
    finally:
        if simulators is not None:
            simulators.terminate()
            simulators.wait(10)


def _serve(
    config: str | None,
    data: dict[str, Any] | None,
    host: str | None,
    port: int | None,
    workers: int | None,
) -> int:
    from gateway.app import load_gateway

    loaded = load_gateway(config, data=data)  # validate before anything starts
    server = loaded.settings.server
    host = host or server.host
    port = port if port is not None else server.port
    workers = workers or server.workers
    if workers == 1:
        _run_loaded(loaded, host, port, reuse_port=False)
        return 0
    if loaded.settings.store.auto_upgrade:
        from gateway.core.store import upgrade

        upgrade(loaded.settings.store.url, loaded.migration_dirs())
    metrics_dir = tempfile.mkdtemp(prefix="pushgw-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    os.environ["PUSHGW__STORE__AUTO_UPGRADE"] = "false"  # done above, once
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_run_worker, args=(config, data, host, port, True, i), name=f"pushgw-{i}"
        )
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()

    def forward(signum: int, _frame: Any) -> None:
        for proc in procs:
            if proc.pid and proc.is_alive():
                os.kill(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        for proc in procs:
            proc.join()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return max((p.exitcode or 0) for p in procs)


def _run_worker(
    config: str | None,
    data: dict[str, Any] | None,
    host: str,
    port: int,
    reuse_port: bool,
    index: int = 0,
) -> None:
    os.environ[WORKER_ENV] = str(index)  # one-per-gateway services run in worker 0 only

    from gateway.app import load_gateway

    _run_loaded(load_gateway(config, data=data), host, port, reuse_port)


def _run_loaded(loaded: LoadedGateway, host: str, port: int, reuse_port: bool) -> None:
    from aiohttp import web

    from gateway import logs
    from gateway.app import create_app
    from gateway.loops import loop_factory

    settings = loaded.settings
    logs.configure(settings.logging.level, settings.logging.json_format)
    loop = loop_factory(settings.server.event_loop)()
    asyncio.set_event_loop(loop)
    where = f"pushgw {os.getpid()} ({type(loop).__module__.split('.')[0]} loop)"
    app = create_app(loaded)
    web.run_app(
        app,
        loop=loop,
        host=host,
        port=port,
        reuse_port=reuse_port,
        shutdown_timeout=settings.server.shutdown_timeout,
        access_log=logging.getLogger("aiohttp.access") if settings.logging.access_log else None,
        print=lambda msg: print(f"{where}: {msg}", file=sys.stderr, flush=True),
    )


def _start_simulators(state_dir: Path) -> subprocess.Popen[bytes]:
    """Start `pushgw simulate` in a child process and wait until its files are written."""
    ready = state_dir / SIMULATOR_READY_FILE
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.testing.standalone", "--state-dir", str(state_dir)]
    )
    deadline = time.monotonic() + 30
    while not ready.exists():  # a file written by another process: polling is the only signal
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("pushgw: error: the simulators did not start")
        time.sleep(0.05)
    print(f"simulators: {json.dumps(json.loads(ready.read_text()))}", file=sys.stderr)
    return proc
