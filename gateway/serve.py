"""`pushgw serve`: one process, or N worker processes sharing the port (SO_REUSEPORT).

With several workers, each is a fresh interpreter (spawned, not forked) so that
prometheus-client starts in multi-process mode and `/metrics` on any worker reports
the sum over all of them. Migrations run once, in the parent, before workers start.

The port is bound before anything starts (migrations, provider clients, workers): a
port in use, a host that is not local or no host name, a privileged port is one line
(`ServeError`, exit status 2), and a database that does not answer is one line too
(exit status 1). `server.metrics_port` is checked then, and held (`reserve`) until the
metrics site listens, so that no other process takes it while the gateway starts.

Workers load the configuration as the parent did (its file, `PUSHGW__...` variables)
and are told by an argument, not by the environment, that the parent has migrated.

With several workers the gateway runs with all of them or not at all: a worker that
exits before SIGTERM or SIGINT came to the parent (it could not listen, a plugin
service failed to start, it crashed) stops the others, and `serve` exits non-zero.
After SIGTERM or SIGINT, a worker that has not stopped within the grace period (a
plugin's `stop()` that never returns) is killed, and `serve` exits non-zero too.

Signals (docs/cli.md): SIGTERM, SIGINT and SIGQUIT stop the gateway gracefully; SIGHUP,
SIGUSR1 and SIGUSR2 are logged and ignored (their default action would end the process
without a drain, losing what it had accepted). A worker whose parent dies, however it
dies, stops gracefully too (Linux), rather than serve on as an orphan holding the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.context import WORKER_ENV
from gateway.core.metrics import MULTIPROC_ENV
from gateway.preflight import PreflightError, check_state_dir, os_reason, resolve
from gateway.systemd import Notifier

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from gateway.app import LoadedGateway

SIMULATOR_READY_FILE = "ready.json"
BACKLOG = 128  # aiohttp's default
EXIT_WORKER_FAILED = 1  # a worker exited 0 or was killed while the gateway ran, or hung
STOP_GRACE = 10.0  # seconds beyond a worker's own shutdown deadlines before SIGKILL
# A graceful stop: systemd and Docker send SIGTERM, a terminal SIGINT (Ctrl-C) or SIGQUIT
# (Ctrl-\), and some images' STOPSIGNAL is SIGQUIT.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# Sent to ask for a reload (logrotate, `systemctl reload`) or by habit: the gateway has
# nothing to reload (its logs go to stderr, its receipt files roll by themselves).
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
IGNORED_WHY = (
    "ignored: pushgw reloads nothing while it runs (restart it to apply a new configuration)"
)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ServeError(Exception):
    """An operator mistake found while starting (port in use, bad host): one line."""


def serve(
    *,
    config: str | None,
    data: dict[str, Any] | None,
    host: str | None,
    port: int | None,
    workers: int | None,
    with_simulators: Path | None = None,
) -> int:
    _early_signals()
    notifier = Notifier.from_environment()  # before any child process starts: see there
    if with_simulators is None:
        return _serve(config, data, host, port, workers, notifier)
    # Until the gateway handles SIGTERM itself (run_app, or the workers' parent), its
    # default action would end this process and leave the simulators running on their
    # ports: unwind instead, so that they are stopped below.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    simulators = _start_simulators(with_simulators)
    try:
        return _serve(config, data, host, port, workers, notifier)
    finally:
        _stop_simulators(simulators)


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # the status a shell reports for a process it ended


def _early_signals() -> None:
    """Until the gateway handles its signals (`_run_loaded`, the workers' parent):
    SIGHUP, SIGUSR1 and SIGUSR2 are a line each, and SIGQUIT is SIGTERM. Its default
    action would dump core: a file of the process's memory, keys included."""
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, _say_ignored)
    signal.signal(signal.SIGQUIT, _quit_as_term)


def _quit_as_term(_signum: int, _frame: Any) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # whatever SIGTERM does now (ends, or unwinds)


def _say_ignored(signum: int, _frame: Any) -> None:
    # os.write, not print(): a handler that interrupts a print() to stderr must not
    # write into the same buffer.
    line = f"pushgw: warning: {_signal_name(signum)} {IGNORED_WHY}\n"
    with contextlib.suppress(OSError):
        os.write(2, line.encode())


def _tell(line: str) -> None:
    """One line on stderr. A stderr whose reader has gone (`pushgw serve 2>&1 | head -1`,
    a log collector restarting) must not stop the gateway, nor its parent's supervision.

    One write, newline included: print() writes the text and its newline apart (stderr
    is write-through), and workers saying something at the same moment (a stop signal)
    ran their lines together into one, which log collectors then took as one record."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _serve(
    config: str | None,
    data: dict[str, Any] | None,
    host: str | None,
    port: int | None,
    workers: int | None,
    notifier: Notifier | None = None,
) -> int:
    from gateway.app import load_gateway

    notifier = notifier or Notifier(None)

    loaded = load_gateway(config, data=data)  # validate before anything starts
    server = loaded.settings.server
    host = host or server.host
    port_from = "server.port" if port is None else "--port"
    port = port if port is not None else server.port
    workers = workers if workers is not None else server.workers
    if not 0 <= port <= 65535:
        raise ServeError(f"port must be 0 to 65535, not {port}")
    if workers < 1:
        raise ServeError(f"workers must be at least 1, not {workers}")
    if port == 0 and workers > 1:
        raise ServeError("port 0 (any free port) would give each worker its own port: give a port")
    metrics_port = server.metrics_port
    if metrics_port is not None:
        if metrics_port == port:
            raise ServeError(f"server.metrics_port must differ from {port_from} ({port})")
        # Free for us alone (a process listening with SO_REUSEPORT too would share it):
        for sock in listen(server.metrics_address, metrics_port, reuse_port=False, what="/metrics"):
            sock.close()
    if workers == 1:
        held: list[socket.socket] = []
        socks: list[socket.socket] = []
        try:
            held = _hold_metrics_port(loaded)
            socks = listen(host, port, reuse_port=False)
            _check_receipts_directory(loaded)
            _prepare_database(loaded)
            _without_auto_upgrade(loaded)  # done above, where its failure is one line
            status = f"serving on {_addresses(socks)}"
            _run_loaded(
                loaded,
                socks,
                held,
                ready=lambda: notifier.ready(status),
                stopping=lambda signum: notifier.stopping(_stopping_status(signum)),
            )
        finally:
            for sock in [*socks, *held]:
                sock.close()
        return 0
    for sock in listen(host, port, reuse_port=False):
        sock.close()  # checked once here; each worker binds its own (SO_REUSEPORT)
    _check_receipts_directory(loaded)
    _prepare_database(loaded)
    try:
        metrics_dir = tempfile.mkdtemp(prefix="pushgw-metrics-")
    except OSError as exc:
        # A read-only root file system with no writable temporary directory mounted:
        # one line, not a traceback out of `tempfile`.
        raise ServeError(
            f"{workers} workers need a writable temporary directory for their metrics "
            f"(mount one, or set TMPDIR to one): {os_reason(exc)}"
        ) from None
    os.environ[MULTIPROC_ENV] = metrics_dir
    ctx = multiprocessing.get_context("spawn")
    # Each worker writes its index here once it serves: the parent tells systemd the
    # gateway is ready when all of them have (`_supervise`).
    ready_reader, ready_writer = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(
            target=_run_worker,
            args=(config, data, host, port, i),
            # migrated above, once
            kwargs={"migrated": True, "parent": os.getpid(), "ready": ready_writer},
            name=f"pushgw-{i}",
        )
        for i in range(workers)
    ]
    stop_signal: int | None = None
    signalled: set[int] = set()  # pids the stop signal was forwarded to

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stop_signal
        if stop_signal is None:
            notifier.stopping(_stopping_status(signum))
        stop_signal = signum
        for proc in procs:
            if proc.pid and proc.is_alive():
                signalled.add(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    # Before the workers start: a signal while they start stops those started so far.
    for signum in STOP_SIGNALS:
        signal.signal(signum, forward)
    try:
        with _signal_wakeup() as wakeup:
            for proc in procs:
                if stop_signal is not None:
                    break
                proc.start()
                if stop_signal is not None and proc.pid and proc.pid not in signalled:
                    os.kill(proc.pid, stop_signal)  # the signal came during start()
            ready_writer.close()  # the workers hold theirs: EOF once all of them exited
            started = [proc for proc in procs if proc.pid]
            grace = server.shutdown_delay + 2 * server.shutdown_timeout + STOP_GRACE
            shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            return _supervise(
                started,
                lambda: stop_signal is not None,
                grace,
                wakeup,
                ready=ready_reader,
                notifier=notifier,
                status=f"serving on {shown} ({workers} workers)",
            )
    finally:
        ready_reader.close()
        ready_writer.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _addresses(socks: Sequence[socket.socket]) -> str:
    """`127.0.0.1:5000, [::1]:5000`: where `socks` listen."""
    shown = []
    for sock in socks:
        host, port = sock.getsockname()[:2]
        shown.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return ", ".join(shown)


def _stopping_status(signum: int) -> str:
    return f"stopping ({_signal_name(signum)}): draining the pushes in flight"


@contextlib.contextmanager
def _signal_wakeup() -> Iterator[int]:
    """A file descriptor that becomes readable when a signal with a handler comes.

    The supervisor blocks in `wait()` on the workers' sentinels, and Python retries that
    wait after running a signal handler (PEP 475): without a descriptor in the list that
    the signal itself makes readable, it would not see SIGTERM until a worker exits, and
    could not bound the shutdown. `signal.set_wakeup_fd` writes from the C-level handler,
    so a signal that comes just before the wait starts wakes it too.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)  # drained without blocking (`_drain`)
    os.set_blocking(write_fd, False)  # as set_wakeup_fd requires: a full pipe never blocks
    previous = signal.set_wakeup_fd(write_fd)
    try:
        yield read_fd
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)


def _drain(fd: int) -> None:
    """Read what the signals wrote, so that `wait()` blocks again."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 512):
            pass


def _supervise(
    procs: Sequence[BaseProcess],
    stopping: Callable[[], bool],
    grace: float,
    wakeup: int | None = None,
    *,
    ready: Connection | None = None,
    notifier: Notifier | None = None,
    status: str = "serving",
) -> int:
    """Wait for the workers to exit; the exit status of `pushgw serve`.

    A worker that exits while the gateway is not `stopping` (no stop signal came)
    ends the gateway: it is named in one line, the others are stopped (`_stop`), and the
    status is that worker's (1 when it exited 0 or was killed by a signal). Once it is
    `stopping` (seen at once when the stop signal makes `wakeup` readable), the workers
    have `grace` seconds to exit; those still running then are named in one line and
    killed (status 1). Otherwise the status is 0 when every worker stopped cleanly.

    `ready`: where each worker writes its index once it serves; when all of `procs`
    have, `notifier` tells systemd the gateway is ready (READY=1, with `status`).
    """
    from multiprocessing.connection import wait

    running: dict[Any, BaseProcess] = {proc.sentinel: proc for proc in procs}
    woken: list[Any] = [] if wakeup is None else [wakeup]
    serving: set[bytes] = set()
    if ready is not None:
        woken.append(ready)
    while running and not stopping():
        for sentinel in wait([*running, *woken]):  # the processes' sentinels: no polling
            if sentinel == wakeup:
                _drain(wakeup)
                continue  # `stopping()`, checked again above, says whether it was a stop
            if sentinel is ready:
                try:
                    serving.add(ready.recv_bytes())
                except (EOFError, OSError):  # every worker exited: their sentinels say how
                    woken.remove(ready)
                    continue
                if len(serving) == len(procs):
                    woken.remove(ready)
                    if notifier is not None:
                        notifier.ready(status)
                continue
            proc = running.pop(sentinel)
            proc.join()
            if stopping():
                continue
            code = proc.exitcode or 0
            if code < 0:
                how = f"was killed by {_signal_name(-code)}"
            else:
                how = f"exited with status {code}"
            index = procs.index(proc)  # procs are the workers started, in order
            _tell(f"pushgw: error: worker {index} (pid {proc.pid}) {how}: stopping the gateway")
            if notifier is not None:
                notifier.stopping(f"worker {index} {how}: stopping")
            _stop(list(running.values()), grace)
            return code if code > 0 else EXIT_WORKER_FAILED
    # The stop signal was forwarded to the workers: each should end within its own
    # shutdown deadlines, but a hung shutdown (a plugin's stop()) must not keep the
    # gateway running for ever; those are killed, and count as killed by SIGKILL (1).
    if late := _reap_until(running.values(), time.monotonic() + grace):
        names = ", ".join(f"worker {procs.index(proc)} (pid {proc.pid})" for proc in late)
        _tell(
            f"pushgw: error: {names} did not stop within {grace:g} seconds "
            f"of the stop signal: killed {'it' if len(late) == 1 else 'them'} (SIGKILL)"
        )
        _kill(late)
    return max((_stopped_status(proc.exitcode) for proc in procs), default=0)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal, say
        return f"signal {signum}"


def _stopped_status(exitcode: int | None) -> int:
    """A worker's contribution to the exit status once the gateway was told to stop."""
    if not exitcode:
        return 0
    if exitcode < 0:  # killed before it could handle the forwarded signal: a clean stop too
        return 0 if -exitcode in STOP_SIGNALS else EXIT_WORKER_FAILED
    return exitcode


def _stop(procs: Sequence[BaseProcess], grace: float) -> None:
    """SIGTERM the workers, give them `grace` seconds to shut down, then SIGKILL the rest."""
    for proc in procs:
        proc.terminate()  # SIGTERM; nothing for a worker that has exited already
    _kill(_reap_until(procs, time.monotonic() + grace))


def _reap_until(procs: Iterable[BaseProcess], deadline: float) -> list[BaseProcess]:
    """Join the workers that exit before `deadline` (time.monotonic); the others."""
    from multiprocessing.connection import wait

    running: dict[Any, BaseProcess] = {proc.sentinel: proc for proc in procs}
    while running:
        # A timeout of 0 once the deadline has passed still reaps those that have exited.
        exited = wait(list(running), timeout=max(deadline - time.monotonic(), 0))
        if not exited:
            break
        for sentinel in exited:
            running.pop(sentinel).join()
    return list(running.values())


def _kill(procs: Iterable[BaseProcess]) -> None:
    """SIGKILL the workers and reap them: none is left behind, not even as a zombie."""
    for proc in procs:
        proc.kill()
        proc.join()


def listen(host: str, port: int, *, reuse_port: bool, what: str = "") -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to, as aiohttp would bind them.

    Raises ServeError naming host and port when any of them cannot be bound, or when
    `host` is no host name (an empty label, one over 63 characters).
    """
    return _bind(host, port, what, reuse_address=True, reuse_port=reuse_port, backlog=BACKLOG)


def reserve(host: str, port: int, *, what: str = "") -> list[socket.socket]:
    """Sockets bound on every address `host` resolves to, not listening: they hold the port.

    Bound with SO_REUSEPORT but not SO_REUSEADDR, they keep any other process from binding
    the port (with SO_REUSEADDR or not), while a socket of this user with SO_REUSEPORT, as
    aiohttp's `TCPSite(reuse_port=True)` binds, can. Not listening, they are given no
    connection. Close them once that socket listens. Raises ServeError as `listen` does.
    """
    return _bind(host, port, what, reuse_address=False, reuse_port=True, backlog=None)


def _bind(
    host: str, port: int, what: str, *, reuse_address: bool, reuse_port: bool, backlog: int | None
) -> list[socket.socket]:
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    shown = f"{shown} ({what})" if what else shown
    try:
        infos = resolve(host, port)
    except PreflightError as exc:
        raise ServeError(f"cannot listen on {shown}: {exc}") from None
    socks: list[socket.socket] = []
    # `::` alone (no IPv4 address beside it) takes IPv4 clients too, as IPv4-mapped
    # addresses, where the OS allows: an operator who writes `::` means every address.
    # Beside an IPv4 address of the same port the IPv6 socket must stay IPv6-only.
    dual_stack = {(family, address[0]) for family, *_, address in infos} == {
        (socket.AF_INET6, "::")
    }
    try:
        seen = set()
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            if reuse_address:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                _set_v6only(sock, not dual_stack)
            sock.bind(address)
            if backlog is not None:
                sock.listen(backlog)
    except (OSError, ValueError) as exc:
        for sock in socks:
            sock.close()
        reason = os_reason(exc) if isinstance(exc, OSError) else str(exc)
        raise ServeError(f"cannot listen on {shown}: {reason}") from None
    return socks


def _set_v6only(sock: socket.socket, v6only: bool) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    except OSError:
        if v6only:
            raise
        # An OS without dual-stack sockets (OpenBSD): `::` stays IPv6 only, as documented.


def _hold_metrics_port(loaded: LoadedGateway) -> list[socket.socket]:
    """`server.metrics_port`, held (`reserve`) until the metrics site listens on it.

    The site starts last, after the database, the provider clients and plugin services:
    a port taken in between would end start-up in a traceback. `_run_loaded` lets go
    of the sockets once the site listens.
    """
    server = loaded.settings.server
    if server.metrics_port is None:
        return []
    try:
        return reserve(server.metrics_address, server.metrics_port, what="/metrics")
    except ServeError:
        # A reservation fails where the site would bind in one case: a connection of an
        # earlier socket without SO_REUSEPORT in TIME_WAIT. Check as the site binds, and
        # hold nothing then.
        for sock in listen(
            server.metrics_address, server.metrics_port, reuse_port=True, what="/metrics"
        ):
            sock.close()
        return []


def _prepare_database(loaded: LoadedGateway) -> None:
    """Migrate (`store.auto_upgrade`) or check the database before the gateway starts: a
    failure is then one line (DatabaseError), not a traceback out of start-up."""
    if loaded.settings.store.auto_upgrade:
        _upgrade(loaded)
    else:
        _check_database(loaded)


def _check_database(loaded: LoadedGateway) -> None:
    """Fail in one line (DatabaseError, ConfigError) now when the database does not answer
    or is not at head, as the other commands do with `store.auto_upgrade` off: a node
    started before `pushgw db upgrade` ran would serve 500s on the missing tables."""
    from gateway.cli import opened_store

    async def check() -> None:
        async with opened_store(loaded, migrate=False):
            pass

    asyncio.run(check())


def _upgrade(loaded: LoadedGateway) -> None:
    """Migrate once, in the parent; DatabaseError in one line when that fails."""
    from gateway.cli import opened_store

    async def upgrade() -> None:
        async with opened_store(loaded, migrate=True):
            pass

    asyncio.run(upgrade())


def _run_worker(
    config: str | None,
    data: dict[str, Any] | None,
    host: str,
    port: int,
    index: int = 0,
    *,
    migrated: bool = False,
    parent: int | None = None,
    ready: Connection | None = None,
) -> None:
    """One of `--workers N`: its errors are one line each, as `pushgw serve`'s own.

    `migrated`: the parent migrated the database (or checked it): don't, whatever
    `store.auto_upgrade` says. `parent`: the pid of the `serve` process that started
    this worker (None when run in-process, by tests): the worker's signals are set up.
    `ready`: where the worker writes its index once it serves (`_supervise`).
    """
    if parent is not None:
        _early_signals()
        _stop_with_parent(parent)
    try:
        _start_worker(config, data, host, port, index, migrated=migrated, ready=ready)
    except KeyboardInterrupt:
        # SIGINT (forwarded by the parent, or a terminal's Ctrl-C to the whole group)
        # before the application handles it: end as the signal would, as SIGTERM then
        # does, for the parent to count a clean stop; not a traceback and status 1.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        if parent is not None and os.getppid() != parent:
            _remove_orphaned_metrics()


def _remove_orphaned_metrics() -> None:
    """The parent died (SIGKILL, the OOM killer) and cannot remove the workers' metrics
    directory: each worker removes its own files as it exits, and the directory once it
    is empty (the last worker out), so no `pushgw-metrics-*` stays behind in $TMPDIR."""
    directory = os.environ.get(MULTIPROC_ENV)
    if not directory:
        return
    for path in Path(directory).glob(f"*_{os.getpid()}.db"):
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):  # not empty: another worker is still exiting
        os.rmdir(directory)


def _stop_with_parent(parent: int) -> None:
    """SIGTERM this worker when its parent dies (Linux's PR_SET_PDEATHSIG).

    A parent killed outright (the OOM killer, `kill -9`, a supervisor that kills the
    main process only) forwards nothing: its workers would serve on as orphans, holding
    the port the restarted gateway needs and the receipts they accepted. Elsewhere
    nothing is set up: stop the whole process group there.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no prctl (a libc without it): as elsewhere
        return
    if os.getppid() != parent:  # it died before prctl took effect: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def _start_worker(
    config: str | None,
    data: dict[str, Any] | None,
    host: str,
    port: int,
    index: int,
    *,
    migrated: bool,
    ready: Connection | None = None,
) -> None:
    os.environ[WORKER_ENV] = str(index)  # one-per-gateway services run in worker 0 only

    from gateway.app import load_gateway
    from gateway.cli import EXIT_FAILED, EXIT_USAGE, DatabaseError
    from gateway.config import ConfigError

    socks: list[socket.socket] = []
    held: list[socket.socket] = []
    try:
        loaded = load_gateway(config, data=data)
        if migrated:
            _without_auto_upgrade(loaded)
        socks = listen(host, port, reuse_port=True)
        held = _hold_metrics_port(loaded)
        _run_loaded(
            loaded, socks, held, ready=None if ready is None else lambda: _tell_parent(ready, index)
        )
    except ConfigError as exc:
        print(f"pushgw: config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except ServeError as exc:
        print(f"pushgw: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except DatabaseError as exc:
        print(f"pushgw: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    finally:
        for sock in [*socks, *held]:
            sock.close()


def _tell_parent(ready: Connection, index: int) -> None:
    """Tell the parent this worker serves; a parent gone meanwhile stops the worker anyway."""
    with contextlib.suppress(OSError):
        ready.send_bytes(str(index).encode())
    ready.close()


def _without_auto_upgrade(loaded: LoadedGateway) -> None:
    """Run `loaded` with `store.auto_upgrade` off (what plugins see in `settings` too)."""
    settings = loaded.settings
    store = settings.store.model_copy(update={"auto_upgrade": False})
    loaded.settings = loaded.runtime.settings = settings.model_copy(update={"store": store})


def _run_loaded(
    loaded: LoadedGateway,
    socks: list[socket.socket],
    held: Sequence[socket.socket] = (),
    *,
    ready: Callable[[], object] | None = None,
    stopping: Callable[[int], object] | None = None,
) -> None:
    """Run the gateway on `socks` until a stop signal (STOP_SIGNALS); `held` (`_hold_metrics_port`)
    is closed once the application has started, its metrics site listening.

    `ready` is called once the gateway serves (every site listening, after its `Running
    on` line); `stopping` with the signal number when the first stop signal comes."""
    from aiohttp import web

    from gateway import logs
    from gateway.app import STOPPING, create_app
    from gateway.loops import loop_factory

    settings = loaded.settings
    logs.configure(settings.logging.level, settings.logging.json_format)
    loop = loop_factory(settings.server.event_loop)()
    asyncio.set_event_loop(loop)
    where = f"pushgw {os.getpid()} ({type(loop).__module__.split('.')[0]} loop)"
    app = create_app(loaded)
    if held:

        async def let_go(_app: web.Application) -> None:
            for sock in held:
                sock.close()

        app.on_startup.append(let_go)  # runs once the cleanup contexts (its site) started

    # aiohttp's own handlers raise GracefulExit on every SIGINT or SIGTERM, and a second
    # one during the graceful shutdown cancels it: requests in flight are cut, receipts
    # not flushed, status 1. A worker always gets two: the parent forwards the signal that
    # systemd (KillMode=control-group) or a terminal's Ctrl-C sent to it and to the
    # worker alike. The first signal starts the shutdown, bounded by shutdown_timeout;
    # the next ones are ignored. With `server.shutdown_delay`, the gateway first serves
    # on that long with /readyz 503, for the balancers to take it out (docs/kubernetes.md).
    stopped = False
    delay = settings.server.shutdown_delay

    def stop(signum: int) -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            if stopping is not None:
                stopping(signum)
            if delay > 0:
                app[STOPPING].begin()
                _tell(
                    f"{where}: {_signal_name(signum)}: /readyz answers 503; still serving "
                    f"for {delay:g} s (server.shutdown_delay), then draining"
                )
                loop.call_later(delay, graceful_exit)
                return
            raise web.GracefulExit()

    def graceful_exit() -> None:
        raise web.GracefulExit()  # out of the loop, as from a signal handler

    def running(msg: str) -> None:
        _tell(f"{where}: {msg}")
        if ready is not None:
            ready()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    for signum in IGNORED_SIGNALS:
        loop.add_signal_handler(signum, _log_ignored, signum)
    web.run_app(
        app,
        loop=loop,
        handle_signals=False,  # `stop` above
        sock=socks,
        shutdown_timeout=settings.server.shutdown_timeout,
        # Idle connections, and a request's headers, are bounded by aiohttp's keep-alive
        # timer (from the connection, or the previous answer); the body by the app's own.
        keepalive_timeout=settings.server.keepalive_timeout,
        access_log=logging.getLogger("aiohttp.access") if settings.logging.access_log else None,
        access_log_class=logs.RouteAccessLogger,  # never the path or query: they may hold tokens
        print=running,  # called once every site listens: the gateway serves
    )


def _log_ignored(signum: int) -> None:
    logging.getLogger("pushgw").warning("%s %s", _signal_name(signum), IGNORED_WHY)


def _start_simulators(state_dir: Path) -> subprocess.Popen[bytes]:
    """Start `pushgw simulate` in a child process and wait until its files are written."""
    _check_state_dir(state_dir)
    ready = state_dir / SIMULATOR_READY_FILE
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.testing.standalone", "--state-dir", str(state_dir)]
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():  # a file written by another process: polling is the only signal
            if proc.poll() is not None:
                # It said why on stderr (a port in use, status 2): a mistake to fix first.
                raise ServeError(f"the simulators did not start (status {proc.returncode})")
            if time.monotonic() > deadline:
                raise SystemExit("pushgw: error: the simulators did not start within 30 s")
            time.sleep(0.05)
    except BaseException:  # SIGINT or SIGTERM while they start, too: not left running
        _stop_simulators(proc)
        raise
    print(f"simulators: {json.dumps(json.loads(ready.read_text()))}", file=sys.stderr)
    return proc


def _stop_simulators(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM first: the simulators then stop the Nostr relay they may have started."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _check_receipts_directory(loaded: LoadedGateway) -> None:
    """`receipts.directory`: made when missing and written into before the gateway
    starts, else ServeError naming it. Found only at the first receipt, a directory that
    cannot be written (a read-only root file system, another user's) let the gateway
    report ready while every receipt it accepted waited in memory, to be lost at exit."""
    receipts = loaded.settings.receipts
    if not receipts.enabled:
        return
    try:
        check_state_dir(receipts.directory)
    except PreflightError as exc:
        raise ServeError(f"receipts.directory {receipts.directory}: {exc}") from None


def _check_state_dir(state_dir: Path) -> None:
    """`--with-simulators DIR`: a directory (made when missing) that files can be written
    into, else ServeError naming it."""
    try:
        check_state_dir(state_dir)
    except PreflightError as exc:
        raise ServeError(f"--with-simulators {state_dir}: {exc}") from None
