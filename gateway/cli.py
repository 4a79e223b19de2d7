"""The `pushgw` command.

Every user mistake (bad config, missing file, unknown plugin) is a one-line message
on stderr and exit status 2; tracebacks are only for our own bugs.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway import __version__
from gateway.config import CONFIG_ENV, ConfigError
from gateway.context import CommandContext

log = logging.getLogger("pushgw")

EXIT_USAGE = 2


class UsageError(Exception):
    """A user mistake outside the config file (bad argument, unreadable input file)."""


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


def _config_data_from_sygnal(args: argparse.Namespace) -> None:
    """`--sygnal-config FILE`: an unchanged Sygnal config becomes pushgw config data."""
    path = getattr(args, "sygnal_config", None)
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
    store = loaded.open_store()
    try:
        await store.upgrade(loaded.migration_dirs())
    finally:
        await store.close()
    print(f"database at head ({store.dialect})")
    return 0


async def cmd_tokens_retire(args: argparse.Namespace, context: CommandContext) -> int:
    """Feed a dead-token file (spark `dead-tokens` job) through the one invalidation path."""
    from gateway.core.push import InvalidToken, ProviderKind

    records = _read_dead_tokens(Path(args.file))
    loaded = context.load()
    retired = skipped = 0
    async with context.open_store():
        assert loaded.invalidation is not None
        for record in records:
            if record["plugin"] not in loaded.contexts:
                skipped += 1
                continue
            provider = record.get("provider")
            invalid = InvalidToken(
                plugin=record["plugin"],
                app_id=record["app_id"],
                token_hash=record["token_hash"],
                token=None,
                provider=ProviderKind(provider) if provider else None,
                reason=record.get("reason"),
            )
            if await loaded.invalidation.report(invalid):
                retired += 1
    print(f"retired {retired} tokens; skipped {skipped} of plugins not enabled")
    return 0


def _read_dead_tokens(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not all(isinstance(record.get(k), str) for k in ("plugin", "app_id", "token_hash")):
                raise ValueError("needs string fields plugin, app_id, token_hash")
        except ValueError as exc:
            raise UsageError(f"{path}:{number}: not a dead-token record ({exc})") from None
        records.append(record)
    return records


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
    return serve.serve(
        config=args.config,
        data=getattr(args, "config_data", None),
        host=args.host,
        port=args.port,
        workers=args.workers,
        with_simulators=Path(args.with_simulators) if args.with_simulators else None,
    )


# --- parser ------------------------------------------------------------------------


def build_parser(plugin_commands: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
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
    serve.add_argument("--port", type=int, help="override server.port")
    serve.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    serve.add_argument(
        "--sygnal-config", metavar="FILE", help="run from an unchanged Sygnal config"
    )
    serve.add_argument(
        "--with-simulators",
        metavar="DIR",
        help="also start the APNs/FCM simulators, writing their CA and keys into DIR",
    )
    serve.set_defaults(handler=cmd_serve)

    check = sub.add_parser("check-config", parents=[common], help="validate and print the config")
    check.add_argument("--sygnal-config", metavar="FILE", help="check a Sygnal config instead")
    check.set_defaults(handler=cmd_check_config)

    plugins = sub.add_parser("plugins", parents=[common], help="list installed plugins")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(handler=cmd_plugins)

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    db_sub.add_parser("upgrade", parents=[common], help="apply all migrations").set_defaults(
        handler=cmd_db_upgrade
    )

    tokens = sub.add_parser("tokens", help="device token maintenance")
    tokens_sub = tokens.add_subparsers(dest="tokens_command", metavar="COMMAND", required=True)
    retire = tokens_sub.add_parser(
        "retire", parents=[common], help="retire the tokens of a dead-token file (spark job output)"
    )
    retire.add_argument("file")
    retire.set_defaults(handler=cmd_tokens_retire)

    sim = sub.add_parser("simulate", help="run the APNs and FCM simulators standalone")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--apns-port", type=int, default=2197)
    sim.add_argument("--fcm-port", type=int, default=4080)
    sim.add_argument("--state-dir", default="var/simulators", help="where CA, key and account go")
    sim.set_defaults(handler=cmd_simulate)

    if plugin_commands is not None:
        plugin_commands(sub)
    return parser


def _plugin_commands(subparsers: Any) -> None:
    """Let every installed plugin add its commands (`pushgw zulip ...`)."""
    from gateway.plugins import PluginRegistry, installed_plugins

    names = [info.name for info in installed_plugins() if info.error is None]
    try:
        registry = PluginRegistry(names)
    except ConfigError as exc:
        print(f"pushgw: warning: plugin commands unavailable: {exc}", file=sys.stderr)
        return
    registry.broadcast("pushgw_commands", subparsers=subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(_plugin_commands)
    args = parser.parse_args(argv)
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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
