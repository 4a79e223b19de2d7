"""The `pushgw` command.

Every user mistake (bad config, bad argument, bad input file, port in use) is
reported on stderr (one line per problem) with exit status 2. Something that could not
be done for another reason (the database is unreachable or refuses, a plugin hook
failed) is reported in one line per problem with exit status 1. A reader of stdout that
goes away (`| head`) ends the command quietly with status 141, as SIGPIPE would.
Tracebacks are only for our own bugs. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import __version__
from gateway.config import CONFIG_ENV, ENV_PREFIX, ConfigError
from gateway.context import CommandContext

if TYPE_CHECKING:
    from gateway.core.store import Store

log = logging.getLogger("pushgw")

EXIT_FAILED = 1
EXIT_USAGE = 2

_PLUGIN_DEST = "_pushgw_plugin"
"""The namespace attribute naming the plugin whose command was run (unset for the core's)."""


class UsageError(Exception):
    """A user mistake outside the config file (bad argument, unreadable input file)."""


class OutputError(Exception):
    """Standard output cannot be written (a full disk, closed): the command stops."""


class DatabaseError(Exception):
    """The database could not be reached or used (exit status 1); `str()` is one line."""


# --- helpers ---------------------------------------------------------------------


def _load(args: argparse.Namespace) -> Any:
    from gateway.app import load_gateway

    data = getattr(args, "config_data", None)
    if data is not None:
        return load_gateway(data=data)
    return load_gateway(args.config)


def _run(result: Any) -> int:
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return int(result or 0)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


SYGNAL_CONF_ENV = "SYGNAL_CONF"
"""Sygnal's variable naming its config file: read as `--sygnal-config` when no config is
given otherwise (no `--config`, `--sygnal-config` or `$PUSHGW_CONFIG`), so that a
container or unit file that sets it keeps working when the command becomes pushgw's."""


def _config_data_from_sygnal(args: argparse.Namespace) -> None:
    """`--sygnal-config FILE` (or `$SYGNAL_CONF`): an unchanged Sygnal config becomes
    pushgw config data."""
    path = getattr(args, "sygnal_config", None)
    if not path and not getattr(args, "config", None) and not os.environ.get(CONFIG_ENV):
        path = os.environ.get(SYGNAL_CONF_ENV) or None
        if path:
            print(f"pushgw: using the Sygnal config ${SYGNAL_CONF_ENV}: {path}", file=sys.stderr)
    if not path:
        return
    try:
        from plugins.matrix.sygnal_config import SygnalConfigError, load_sygnal_config
    except ImportError as exc:  # the matrix plugin is not installed
        raise UsageError(f"--sygnal-config needs the matrix plugin: {exc}") from None
    try:
        args.config_data = load_sygnal_config(path)
    except SygnalConfigError as exc:
        raise ConfigError(exc.problems, str(path)) from None


def no_config_note(args: argparse.Namespace, loaded: Any) -> None:
    """Say so when a command that writes runs on the built-in defaults (and, when any
    `PUSHGW__...` variable is set, on those overrides too)."""
    if loaded.source is None and getattr(args, "config_data", None) is None:
        using = "the built-in defaults"
        if loaded.settings.env_origins:
            using += f" and {ENV_PREFIX} environment overrides"
        print(f"pushgw: no --config or ${CONFIG_ENV}: using {using}", file=sys.stderr)


def shown_url(url: str) -> str:
    """The store URL as it may be shown: its password (and secret query values) masked."""
    from gateway.config import mask_url

    return mask_url(url)


@contextlib.contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turn trouble with the database (unreachable, refusing, failing) into one line."""
    from alembic.script.revision import RevisionError
    from alembic.util import CommandError
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from gateway.core.store import MigrationRefused
    from gateway.core.tokens import describe_error

    try:
        yield
    except MigrationRefused as exc:  # says what to do itself
        raise DatabaseError(f"database {shown_url(url)}: {exc}") from None
    except (OSError, SQLAlchemyError, CommandError, RevisionError) as exc:
        reason = describe_error(exc)
        with contextlib.suppress(Exception):
            password = make_url(url).password
            if password:
                reason = reason.replace(str(password), "***")
        raise DatabaseError(f"database {shown_url(url)}: {reason}") from None


def open_configured_store(loaded: Any) -> Store:
    """The configured store; a store.url that cannot work is a config error."""
    from sqlalchemy.exc import ArgumentError, InvalidRequestError

    from gateway.core.tokens import describe_error

    url = loaded.settings.store.url
    try:
        store: Store = loaded.open_store()
    except (ArgumentError, InvalidRequestError, ImportError) as exc:
        problem = (
            f"store.url: cannot use it ({exc}); "
            "expected sqlite+aiosqlite:///PATH or postgresql+asyncpg://..."
        )
        raise ConfigError([problem], loaded.source) from None
    except OSError as exc:  # the directory of the SQLite file could not be made
        raise DatabaseError(f"database {shown_url(url)}: {describe_error(exc)}") from None
    return store


@contextlib.asynccontextmanager
async def opened_store(loaded: Any, *, migrate: bool) -> AsyncIterator[Store]:
    """The store, migrated to head (`migrate`) or checked to be at head, else DatabaseError.

    While it is open, plugin contexts' `store` handles work too.
    """
    store = open_configured_store(loaded)
    try:
        with database_errors(store.url):
            if migrate:
                await store.upgrade(loaded.migration_dirs(), known=loaded.known_migration_dirs())
            else:
                pending = await _pending_migrations(
                    store, loaded.migration_dirs(), loaded.known_migration_dirs()
                )
                if pending:
                    raise DatabaseError(
                        f"database {shown_url(store.url)}: not migrated "
                        f"({', '.join(pending)} pending) and store.auto_upgrade is false: "
                        "run `pushgw db upgrade`"
                    )
        yield store
    finally:
        await store.close()
        loaded.runtime.store = None


async def _pending_migrations(
    store: Store, version_locations: Sequence[str], known: Sequence[str] = ()
) -> list[str]:
    """Revisions of the core and the enabled plugins that the database lacks (`known`:
    other plugins' directories, to locate what plugins disabled since left there)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from gateway.core.store import alembic_config, branch_heads, check_known

    extra = [d for d in known if d not in version_locations]
    cfg = alembic_config(store.url, [*version_locations, *extra])
    script = ScriptDirectory.from_config(cfg)
    async with store.engine.connect() as conn:
        current = await conn.run_sync(
            lambda sync: MigrationContext.configure(sync).get_current_heads()
        )
    check_known(script, current, branch_heads(cfg, version_locations))
    applied = {r.revision for r in script.iterate_revisions(tuple(current), "base") if r}
    wanted = {
        r.revision
        for head in branch_heads(cfg, version_locations)
        for r in script.iterate_revisions(head, "base")
        if r
    }
    return sorted(wanted - applied)


# --- commands ------------------------------------------------------------------


def cmd_check_config(args: argparse.Namespace, _ctx: Any) -> int:
    from gateway.config import masked

    _config_data_from_sygnal(args)
    loaded = _load(args)
    normalized = masked(loaded.settings, loaded.plugin_sections())
    normalized["apps"] = sorted(f"{p}/{a}" for p, a in loaded.apps)
    print(json.dumps(normalized, indent=2, sort_keys=True, default=str))
    print(
        f"configuration OK: {len(loaded.registry.names)} plugins, {len(loaded.apps)} apps",
        file=sys.stderr,
    )
    return 0


def cmd_plugins(args: argparse.Namespace, _ctx: Any) -> int:
    from gateway.plugins import installed_plugins

    enabled: list[str] = []
    if args.config or os.environ.get(CONFIG_ENV):
        enabled = _load(args).registry.names
    infos = installed_plugins(enabled)
    if args.json:
        print(json.dumps([info.__dict__ for info in infos], indent=2))
        return 0
    for info in infos:
        state = "enabled" if info.enabled else "installed"
        where = f"{info.distribution} {info.version}" if info.distribution else info.target
        print(f"{info.name:<16} {state:<10} {where}")
        if info.error:
            print(f"{'':<16} failed to load: {info.error}")
        else:
            print(f"{'':<16} hooks: {', '.join(info.hooks) or '-'}")
    return 0


async def cmd_db_upgrade(args: argparse.Namespace, _ctx: Any) -> int:
    loaded = _load(args)
    no_config_note(args, loaded)
    async with opened_store(loaded, migrate=True) as store:
        dialect = store.dialect
    print(f"database at head ({dialect}): {shown_url(loaded.settings.store.url)}")
    return 0


async def cmd_db_downgrade(args: argparse.Namespace, _ctx: Any) -> int:
    """Roll the database back to an older release's revisions (docs/cli.md)."""
    loaded = _load(args)
    no_config_note(args, loaded)
    store = open_configured_store(loaded)
    # every installed plugin's revisions: a disabled plugin's branch may need undoing too
    dirs = [*loaded.migration_dirs(), *loaded.known_migration_dirs()]
    try:
        with database_errors(store.url):
            heads = await store.downgrade(args.revisions, list(dict.fromkeys(dirs)))
        dialect = store.dialect
    finally:
        await store.close()
    shown = ", ".join(heads) or "no revision"
    print(f"database at {shown} ({dialect}): {shown_url(loaded.settings.store.url)}")
    return 0


def cmd_db_backup(args: argparse.Namespace, _ctx: Any) -> int:
    """Copy the SQLite database into a new file while the gateway may run (docs/backup.md)."""
    import sqlite3

    from gateway.core.store import BackupRefused, sqlite_backup
    from gateway.core.tokens import describe_error

    loaded = _load(args)
    no_config_note(args, loaded)
    url = loaded.settings.store.url
    dest = Path(args.dest)
    if os.path.lexists(dest):
        raise UsageError(f"{dest}: already exists: give the name of a new file")
    if not dest.parent.is_dir():
        raise UsageError(f"{dest.parent}: no such directory")
    if loaded.settings.store.url.partition(":")[0] != "sqlite+aiosqlite":
        raise UsageError(
            f"database {shown_url(url)}: `db backup` copies a SQLite database; "
            "back PostgreSQL up with pg_dump (docs/backup.md)"
        )
    try:
        revisions = sqlite_backup(url, dest)
    except FileExistsError:  # made while the copy was written: left as it is
        raise UsageError(f"{dest}: already exists: give the name of a new file") from None
    except BackupRefused as exc:
        raise DatabaseError(f"database {shown_url(url)}: {exc}") from None
    except (sqlite3.Error, OSError) as exc:
        raise DatabaseError(
            f"database {shown_url(url)}: backup to {dest} failed: {describe_error(exc)}"
        ) from None
    at = ", ".join(revisions) or "no revision"
    print(f"backed up {shown_url(url)} (at {at}) to {dest}")
    return 0


def cmd_receipts_cat(args: argparse.Namespace, context: CommandContext) -> int:
    """Print receipts as JSON Lines, whatever their files' format (docs/cli.md).

    Every named path is checked before anything is printed; a file that cannot be read
    is named on stderr, the others are still printed, and the status is 1.
    """
    from gateway.receipt_files import ReceiptFileError, copy_receipts, published_files

    paths = [Path(p) for p in args.paths] or [context.load().settings.receipts.directory]
    for path in paths:
        _check_exists(path)
    if sys.stdout is None:
        raise OutputError("stdout is closed")
    problems: list[ReceiptFileError] = []
    files: list[Path] = []
    for path in paths:
        files += published_files(path, problems.append) if path.is_dir() else [path]
    for problem in problems:
        print(f"pushgw: {problem}", file=sys.stderr)
    out = _Stdout(sys.stdout.buffer)  # sys.stdout is main's _Stdout: its raw buffer
    for file in files:
        try:
            copy_receipts(file, out)
        except ReceiptFileError as exc:
            out.flush()  # what was printed before comes first
            print(f"pushgw: {exc}", file=sys.stderr)
            problems.append(exc)
    return EXIT_FAILED if problems else 0


def _check_exists(path: Path) -> None:
    """A path given on the command line can be looked at: else a usage error."""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file or directory") from None
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or type(exc).__name__}") from None


def cmd_simulate(args: argparse.Namespace, _ctx: Any) -> int:
    from gateway.testing.standalone import run_simulators

    return run_simulators(
        host=args.host,
        apns_port=args.apns_port,
        fcm_port=args.fcm_port,
        state_dir=Path(args.state_dir),
    )


def cmd_serve(args: argparse.Namespace, _ctx: Any) -> int:
    from gateway import serve

    _config_data_from_sygnal(args)
    try:
        return serve.serve(
            config=args.config,
            data=getattr(args, "config_data", None),
            host=args.host,
            port=args.port,
            workers=args.workers,
            with_simulators=Path(args.with_simulators) if args.with_simulators else None,
        )
    except serve.ServeError as exc:
        raise UsageError(str(exc)) from None


# --- argument types ----------------------------------------------------------------


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port), as server.port accepts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 to 65535 (0: any free port), not {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


# --- parser ------------------------------------------------------------------------


def build_parser(plugin_commands: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
    # here, not at the top: the command modules import this one's helpers
    from gateway.token_commands import cmd_tokens_hash, cmd_tokens_retire, cmd_tokens_status

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-c",
        "--config",
        default=argparse.SUPPRESS,
        help=f"YAML config file (default: ${CONFIG_ENV})",
    )
    parser = argparse.ArgumentParser(
        prog="pushgw", description="Privacy-preserving push gateway.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"pushgw {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", parents=[common], help="run the gateway")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument(
        "--port", type=port_number, help="override server.port (0 to 65535; 0: any free port)"
    )
    serve.add_argument(
        "--workers",
        type=positive_int,
        help="override server.workers: processes sharing the port (SO_REUSEPORT)",
    )
    serve.add_argument(
        "--sygnal-config",
        metavar="FILE",
        help="run from an unchanged Sygnal config (default: $SYGNAL_CONF, when no --config"
        " or $PUSHGW_CONFIG)",
    )
    serve.add_argument(
        "--with-simulators",
        metavar="DIR",
        help="also start the APNs/FCM simulators, writing their CA and keys into DIR",
    )
    serve.set_defaults(handler=cmd_serve)

    check = sub.add_parser("check-config", parents=[common], help="validate and print the config")
    check.add_argument(
        "--sygnal-config",
        metavar="FILE",
        help="check a Sygnal config instead (default: $SYGNAL_CONF, when no --config"
        " or $PUSHGW_CONFIG)",
    )
    check.set_defaults(handler=cmd_check_config)

    plugins = sub.add_parser("plugins", parents=[common], help="list installed plugins")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(handler=cmd_plugins)

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    db_sub.add_parser("upgrade", parents=[common], help="apply all migrations").set_defaults(
        handler=cmd_db_upgrade
    )
    down = db_sub.add_parser(
        "downgrade", parents=[common], help="roll back to an older release's revisions"
    )
    down.add_argument(
        "revisions",
        nargs="+",
        metavar="REVISION",
        help="the revisions of the release rolled back to (its refusal to start names them)",
    )
    down.set_defaults(handler=cmd_db_downgrade)
    backup = db_sub.add_parser(
        "backup",
        parents=[common],
        help="copy the SQLite database into a new file, also while the gateway runs",
    )
    backup.add_argument("dest", metavar="FILE", help="the new file (must not exist)")
    backup.set_defaults(handler=cmd_db_backup)

    tokens = sub.add_parser("tokens", help="device token maintenance")
    tokens_sub = tokens.add_subparsers(dest="tokens_command", metavar="COMMAND", required=True)
    retire = tokens_sub.add_parser(
        "retire", parents=[common], help="retire the tokens of a dead-token file (spark job output)"
    )
    retire.add_argument("file")
    retire.set_defaults(handler=cmd_tokens_retire)
    hash_ = tokens_sub.add_parser(
        "hash",
        parents=[common],
        help="print the keyed hash that receipts carry for a device token (read from stdin)",
    )
    hash_.add_argument(
        "token",
        nargs="?",
        metavar="TOKEN",
        help="the device token (default, or -: one per line on stdin; an argument stays "
        "in the shell's history)",
    )
    hash_.set_defaults(handler=cmd_tokens_hash)
    status = tokens_sub.add_parser(
        "status",
        parents=[common],
        help="whether, when and why tokens were retired (their dead-token records)",
    )
    status.add_argument(
        "hashes", nargs="+", metavar="HASH", help="receipts' token_hash (`pushgw tokens hash`)"
    )
    status.set_defaults(handler=cmd_tokens_status)

    receipts = sub.add_parser("receipts", help="delivery receipts files")
    receipts_sub = receipts.add_subparsers(
        dest="receipts_command", metavar="COMMAND", required=True
    )
    cat = receipts_sub.add_parser(
        "cat", parents=[common], help="print receipts as JSON Lines, from either file format"
    )
    cat.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="receipts directories or files (default: the config's receipts.directory)",
    )
    cat.set_defaults(handler=cmd_receipts_cat)

    sim = sub.add_parser("simulate", help="run the APNs and FCM simulators standalone")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--apns-port", type=port_number, default=2197)
    sim.add_argument("--fcm-port", type=port_number, default=4080)
    sim.add_argument("--state-dir", default="var/simulators", help="where CA, key and account go")
    sim.set_defaults(handler=cmd_simulate)

    if plugin_commands is not None:
        plugin_commands(sub)
    return parser


def _plugin_commands(subparsers: Any) -> None:
    """Let every installed plugin add its commands (`pushgw zulip ...`)."""
    from gateway.core.errors import kind_and_place
    from gateway.plugins import PluginRegistry, installed_plugins

    names = [info.name for info in installed_plugins() if info.error is None]
    try:
        registry = PluginRegistry(names)
    except ConfigError as exc:
        print(f"pushgw: warning: plugin commands unavailable: {exc}", file=sys.stderr)
        return
    # Each plugin on its own: every installed plugin is asked, enabled or not, and one
    # whose hook raises must not take every `pushgw` command (serve included) with it.
    for name in registry.implementers("pushgw_commands"):
        before = set(subparsers.choices)
        try:
            registry.call(name, "pushgw_commands", subparsers=subparsers)
        except Exception as exc:
            print(
                f"pushgw: warning: plugin '{name}': its pushgw_commands hook raised "
                f"{kind_and_place(exc)}; its commands are unavailable",
                file=sys.stderr,
            )
        # So that a failure of one of its commands names the plugin (`_run_command`).
        for command in set(subparsers.choices) - before:
            subparsers.choices[command].set_defaults(**{_PLUGIN_DEST: name})


def _command_logging() -> None:
    """Warnings and errors that commands log, one `pushgw: level: ...` line each, an
    exception named by its kind only. Without a handler, logging's last resort prints an
    exception's message with its traceback, and a message may quote a token or a
    database statement's parameters. Left alone when the process already has handlers
    (an embedding program's, a test's); `serve` sets up its own (`logging.*`)."""
    from gateway import logs

    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logs.OneLineFormatter())
    handler.setLevel(logging.WARNING)
    root.addHandler(handler)
    logs.quiet_third_party()


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command killed by SIGPIPE
EXIT_INTERRUPTED = 128 + 2  # Ctrl-C (SIGINT), as a shell reports


def _stdout_closed() -> int:
    """The reader of stdout went away (`pushgw spark list | head -1`): stop quietly.

    Python ignores SIGPIPE, so a write into a closed pipe raises BrokenPipeError; the
    shell convention is to end as SIGPIPE would, without a word.
    """
    _discard_stdout()
    return EXIT_BROKEN_PIPE


def _discard_stdout() -> None:
    """What is still buffered for stdout goes to /dev/null, else the interpreter's own
    flush at exit fails again (and says so)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


@contextlib.contextmanager
def _output_errors() -> Iterator[None]:
    """An OSError writing stdout as `OutputError`; a reader gone away stays BrokenPipeError."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(exc.strerror or type(exc).__name__) from None


class _Stdout:
    """Standard output whose write failures, other than a reader gone away (handled
    apart), are `OutputError`: a full disk is then one line, not a traceback from
    whichever `print()` hit it. Text or binary, as the stream it wraps."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def write(self, data: Any) -> int:
        with _output_errors():
            return int(self._raw.write(data))

    def flush(self) -> None:
        with _output_errors():
            self._raw.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (docs/cli.md)."""
    _own_metrics_directory()
    stdout = sys.stdout
    if stdout is not None:  # None when started with stdout closed: print() is a no-op
        sys.stdout = _Stdout(stdout)  # type: ignore[assignment]
    try:
        try:
            return _run_command(argv)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # here, not at exit, so that a reader gone away is seen
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C before the command ran (loading plugins, say)
        return EXIT_INTERRUPTED
    except OutputError as exc:
        _discard_stdout()
        print(f"pushgw: error: cannot write to stdout: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        sys.stdout = stdout


# prometheus-client's multi-process mode, chosen from these when it is first imported
# (gateway.core.metrics would import it: named here as it spells them).
_MULTIPROC_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def _own_metrics_directory() -> None:
    """Drop a metrics directory inherited from the environment (a gunicorn habit), before
    prometheus-client is imported. One process counts in memory; `serve --workers N` makes
    a fresh directory of its own. An inherited one broke both: a directory that does not
    exist was a traceback at start, and one that does was never emptied, so a previous
    run's counts (or another program's) were added to this one's on /metrics."""
    inherited = [name for name in _MULTIPROC_VARIABLES if name in os.environ]
    for name in inherited:
        del os.environ[name]
    if inherited:
        print(
            f"pushgw: warning: {inherited[0]} ignored: pushgw keeps its own metrics "
            "(in memory, or a fresh directory with --workers N)",
            file=sys.stderr,
        )


def _shown_arguments(args: argparse.Namespace, extras: list[str]) -> str:
    """The arguments a command did not take, as its usage error quotes them: for the
    `tokens` commands, not at all. A second token given to `tokens hash`, or one that
    starts with "-" (an option to argparse: base64url tokens may), would be printed."""
    if getattr(args, "tokens_command", None) is not None:
        return "not shown (they may be device tokens: give tokens on stdin, one a line)"
    return " ".join(extras)


def _run_command(argv: Sequence[str] | None) -> int:
    _command_logging()
    parser = build_parser(_plugin_commands)
    args, extras = parser.parse_known_args(argv)
    if extras:  # what `parse_args` does, but never echoing a device token
        parser.error(f"unrecognized arguments: {_shown_arguments(args, extras)}")
    if not hasattr(args, "config"):
        args.config = None
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    context = CommandContext(args.config, lambda path: _load(args))
    try:
        return _run(handler(args, context))
    except ConfigError as exc:
        print(f"pushgw: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"pushgw: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DatabaseError as exc:
        print(f"pushgw: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (BrokenPipeError, OutputError):
        raise  # stdout's failures, handled by `main`
    except Exception as exc:
        plugin = getattr(args, _PLUGIN_DEST, None)
        if plugin is None:
            raise  # a bug of ours: its traceback
        return _plugin_command_failed(plugin, args.command, exc)


def _plugin_command_failed(plugin: str, command: str, exc: Exception) -> int:
    """A plugin command's exception, in one line as every other plugin hook's failure:
    its kind and place, never its message or frames (they may quote a token)."""
    from gateway.core.errors import kind_and_place

    print(
        f"pushgw: error: plugin '{plugin}': its command '{command}' raised {kind_and_place(exc)}",
        file=sys.stderr,
    )
    return EXIT_FAILED


if __name__ == "__main__":
    # `python -m gateway.cli`: run the importable module's main, so that the errors other
    # modules raise (gateway.serve raises gateway.cli.DatabaseError) are the ones caught.
    from gateway.cli import main as _main

    sys.exit(_main())
