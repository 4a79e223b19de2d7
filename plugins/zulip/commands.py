"""`pushgw zulip ...` commands.

    pushgw zulip add-server [--uuid U] [--key K] --hostname H --email E
    pushgw zulip servers
    pushgw zulip disable (--server UUID | --realm UUID) [--reason TEXT]
    pushgw zulip enable  (--server UUID | --realm UUID)
    pushgw zulip deactivate --server UUID            (as the server's own server/deactivate)
    pushgw zulip keys generate|add [--file PATH]     (prints only the public half)
    pushgw zulip keys list [--file PATH]
    pushgw zulip keys remove PUBLIC [--file PATH]
    pushgw zulip gc [--older-than 30d] [--dry-run]
    pushgw zulip rehash-tokens                       (after rotating receipts.hmac_key)
    pushgw zulip forget (--realm UUID --token-id ID | --server UUID --user-id N|--user-uuid U
                         | --server UUID --all | --token-hash HASH)
                                                     (erase registrations, or a server, now)

Bouncer keys live in the JSON file named by `plugins.zulip.bouncer_keys_file` or `--file`
(the same `{public: private}` shape as Zulip's `push_registration_encryption_keys`); a
running gateway picks up changes on restart. Without either (keys inline in the config,
or none), `keys generate|add|remove` exit with status 2, a configuration mistake.
Output never contains a private key, a server key hash or a device token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import string
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.api import CommandContext, expand_home
from plugins.zulip import repo
from plugins.zulip.config import ZulipConfig
from plugins.zulip.crypto import (
    CryptoError,
    generate_bouncer_key,
    load_bouncer_keys,
    token_id_to_int64,
)
from plugins.zulip.errors import ZulipError
from plugins.zulip.gc import collect, parse_duration
from plugins.zulip.validation import validate_email, validate_hostname, validate_org_id

__all__ = ["add_commands"]

PLUGIN = "zulip"


def add_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    zulip = subparsers.add_parser(PLUGIN, help="Zulip push bouncer administration")
    sub = zulip.add_subparsers(dest="zulip_command", required=True)

    add = sub.add_parser("add-server", help="register a Zulip server (for registration: closed)")
    add.add_argument("--uuid", help="the server's zulip_org_id (default: a new UUID)")
    add.add_argument("--key", help="the server's zulip_org_key (default: 64 random characters)")
    add.add_argument("--hostname", required=True)
    add.add_argument("--email", required=True, help="contact e-mail of the server's admin")
    add.set_defaults(handler=cmd_add_server)

    servers = sub.add_parser("servers", help="list registered servers and their realms")
    servers.set_defaults(handler=cmd_servers)

    for name, enable in (("disable", False), ("enable", True)):
        p = sub.add_parser(name, help=f"{name} pushes for a server or realm (can_push)")
        target = p.add_mutually_exclusive_group(required=True)
        target.add_argument("--server", help="server UUID")
        target.add_argument("--realm", help="realm UUID")
        if not enable:
            p.add_argument("--reason", default=None, help="told to the Zulip server")
        p.set_defaults(handler=cmd_enable if enable else cmd_disable)

    deactivate = sub.add_parser(
        "deactivate",
        help="deactivate a server as its own server/deactivate does (frees its hostname)",
    )
    deactivate.add_argument("--server", required=True, help="server UUID")
    deactivate.set_defaults(handler=cmd_deactivate)

    set_key = sub.add_parser(
        "set-key", help="replace a server's zulip_org_key (one its administrator lost)"
    )
    set_key.add_argument("--server", required=True, help="server UUID")
    set_key.add_argument("--key", help="the new zulip_org_key (default: 64 random characters)")
    set_key.set_defaults(handler=cmd_set_key)

    keys = sub.add_parser("keys", help="bouncer key pairs (E2EE registrations)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    for name in ("generate", "add"):
        gen = keys_sub.add_parser(name, help="add a new key pair; prints its public half")
        gen.add_argument("--file", help="key file (default: plugins.zulip.bouncer_keys_file)")
        gen.set_defaults(handler=cmd_keys_generate)
    lst = keys_sub.add_parser("list", help="print the public keys")
    lst.add_argument("--file", help="key file (default: the configured keys)")
    lst.set_defaults(handler=cmd_keys_list)
    rm = keys_sub.add_parser("remove", help="remove a key pair")
    rm.add_argument("public_key")
    rm.add_argument("--file", help="key file (default: plugins.zulip.bouncer_keys_file)")
    rm.set_defaults(handler=cmd_keys_remove)

    rehash = sub.add_parser(
        "rehash-tokens",
        help="remake the stored token hashes under the current receipts.hmac_key",
    )
    rehash.set_defaults(handler=cmd_rehash_tokens)

    forget = sub.add_parser(
        "forget", help="erase a device's or a user's registrations now (an erasure request)"
    )
    which = forget.add_mutually_exclusive_group(required=True)
    which.add_argument("--realm", help="realm UUID, with --token-id: one E2EE device")
    which.add_argument("--server", help="server UUID, with --user-id or --user-uuid")
    which.add_argument(
        "--token-hash", help="the receipts' token_hash: every registration of that token"
    )
    forget.add_argument("--token-id", help="the device's push_token_id (decimal or base64)")
    user = forget.add_mutually_exclusive_group()
    user.add_argument("--user-id", help="the Zulip user id: all of the user's legacy devices")
    user.add_argument("--user-uuid", help="the Zulip user UUID: all of the user's legacy devices")
    user.add_argument(
        "--all",
        action="store_true",
        help="with --server: the whole server (its row, realms and every registration)",
    )
    forget.set_defaults(handler=cmd_forget)

    gc = sub.add_parser("gc", help="delete registrations dead for longer than the retention")
    gc.add_argument("--older-than", default=None, help="retention, e.g. 30d (default: config)")
    gc.add_argument("--dry-run", action="store_true", help="count only")
    gc.set_defaults(handler=cmd_gc)


# --- helpers ---------------------------------------------------------------------------


MAX_REASON_LEN = 255
"""The `disabled_reason` columns' length (PostgreSQL enforces it)."""


EXIT_FAILED = 1
EXIT_USAGE = 2  # a mistake to fix first: the configuration or the arguments (docs/cli.md)


def _fail(message: str, status: int = EXIT_FAILED) -> int:
    print(f"pushgw zulip: {message}", file=sys.stderr)
    return status


NO_KEYS_FILE = (
    "no key file: set plugins.zulip.bouncer_keys_file, or pass --file PATH "
    "(keys given inline as plugins.zulip.bouncer_keys cannot be changed by this command)"
)


@contextlib.asynccontextmanager
async def open_store(command_context: CommandContext) -> AsyncIterator[tuple[AsyncEngine, Any]]:
    """The gateway's store for a command, migrated like at start-up."""
    async with command_context.open_store() as store:
        yield store.engine, command_context.load()


def _config(loaded: Any) -> ZulipConfig:
    context = loaded.contexts.get(PLUGIN)
    if context is None or not isinstance(context.config, ZulipConfig):
        raise SystemExit(_fail("the zulip plugin is not enabled in this configuration", EXIT_USAGE))
    return context.config


def _keys_file(args: argparse.Namespace, command_context: CommandContext) -> Path | None:
    if args.file:
        return Path(args.file)
    # The section as written, not validated: validation reads the key file, so a file
    # not created yet (the first `keys generate` of the documented set-up) or holding the
    # broken entry `keys remove` is to take out would refuse the command that fixes it.
    raw = command_context.plugin_section(PLUGIN).get("bouncer_keys_file")
    if not raw:
        return None
    try:
        return expand_home(str(raw))
    except ValueError as exc:  # `~nosuchuser/...`: the config's error, not a traceback
        raise KeyFileError(f"plugins.zulip.bouncer_keys_file: {exc}") from None


class KeyFileError(Exception):
    """The key file cannot be read, parsed or written; the message is one line without
    key material."""


def _read_keys(path: Path) -> dict[str, str]:
    try:
        if not path.exists():
            return {}
        text = path.read_text().strip()
    except OSError as exc:  # a directory, a file of another user, ...
        raise KeyFileError(f"{path}: cannot read: {exc.strerror or type(exc).__name__}") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not UTF-8 text") from None
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        data = None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise KeyFileError(f"{path}: the key file must hold a JSON object {{public: private}}")
    return data


def _write_keys(path: Path, keys: dict[str, str]) -> None:
    """Atomically, readable by the owner only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".zulip-keys-", dir=path.parent)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot write: {exc.strerror or type(exc).__name__}") from None
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(keys, out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):  # a full disk, `path` is a directory, ...
            raise KeyFileError(
                f"{path}: cannot write: {exc.strerror or type(exc).__name__}"
            ) from None
        raise


# --- handlers ---------------------------------------------------------------------------


def _new_server_key() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(64))


def _print_secrets(org_id: str, key: str) -> None:
    print("Put these into the Zulip server's /etc/zulip/zulip-secrets.conf:")
    print(f"zulip_org_id = {org_id}")
    print(f"zulip_org_key = {key}")


async def cmd_add_server(args: argparse.Namespace, command_context: CommandContext) -> int:
    org_id = args.uuid or str(uuid.uuid4())
    key = args.key or _new_server_key()
    try:
        validate_org_id(org_id)
        validate_hostname(args.hostname)
        validate_email(args.email)
    except ZulipError as exc:
        return _fail(exc.msg, EXIT_USAGE)
    if len(key) != 64:
        return _fail("--key must be 64 characters", EXIT_USAGE)
    async with open_store(command_context) as (engine, _loaded), engine.begin() as conn:
        if await repo.get_server(conn, org_id) is not None:
            return _fail(f"server {org_id} is already registered")
        if await repo.hostname_in_use(conn, args.hostname, org_id):
            return _fail(f"a server with hostname {args.hostname} already exists")
        await repo.create_server(conn, org_id, key, args.hostname, args.email)
    print(f"registered server {org_id} ({args.hostname})")
    if not args.key:
        _print_secrets(org_id, key)
    return 0


async def cmd_servers(args: argparse.Namespace, command_context: CommandContext) -> int:
    from sqlalchemy import select

    from plugins.zulip.tables import realms

    async with open_store(command_context) as (engine, _loaded), engine.connect() as conn:
        for server in await repo.list_servers(conn):
            state = "deactivated" if server.deactivated_at else "active"
            if server.push_disabled:
                state += ", push disabled"
            print(f"{server.uuid}  {server.hostname}  {state}  version={server.version or '-'}")
            rows = await conn.execute(select(realms).where(realms.c.server_id == server.id))
            for realm in rows:
                flags = [
                    f
                    for f, on in (
                        ("deactivated", realm.deactivated),
                        ("deleted", realm.locally_deleted_at is not None),
                        ("push disabled", realm.push_disabled),
                    )
                    if on
                ]
                suffix = f"  ({', '.join(flags)})" if flags else ""
                print(f"    realm {realm.uuid}  {realm.host}{suffix}")
    return 0


async def _set_disabled(
    args: argparse.Namespace, command_context: CommandContext, disabled: bool
) -> int:
    reason = getattr(args, "reason", None)
    if reason is not None and len(reason) > MAX_REASON_LEN:
        return _fail(f"--reason is too long (limit: {MAX_REASON_LEN} characters)", EXIT_USAGE)
    async with open_store(command_context) as (engine, _loaded), engine.begin() as conn:
        if args.server:
            found = await repo.set_server_disabled(conn, args.server, disabled, reason)
        else:
            found = await repo.set_realm_disabled(conn, args.realm, disabled, reason)
    if not found:
        return _fail("no such server or realm")
    print(("disabled" if disabled else "enabled") + f" {args.server or args.realm}")
    return 0


async def cmd_disable(args: argparse.Namespace, command_context: CommandContext) -> int:
    return await _set_disabled(args, command_context, True)


async def cmd_enable(args: argparse.Namespace, command_context: CommandContext) -> int:
    return await _set_disabled(args, command_context, False)


async def cmd_deactivate(args: argparse.Namespace, command_context: CommandContext) -> int:
    """What `server/deactivate` does, for a server that will not call it: an impostor
    holding a hostname under `registration: open`. Its hostname is then free and every
    call it makes fails as for a self-deactivated server; there is no undoing it."""
    async with open_store(command_context) as (engine, _loaded), engine.begin() as conn:
        server = await repo.get_server(conn, args.server)
        if server is None:
            return _fail("no such server")
        if server.deactivated_at is not None:  # keep the date: gc counts from it
            print(f"{args.server} was already deactivated")
            return 0
        await repo.update_server(conn, server.id, deactivated_at=repo.now_utc())
    print(f"deactivated {args.server} ({server.hostname})")
    return 0


async def cmd_set_key(args: argparse.Namespace, command_context: CommandContext) -> int:
    """A new `zulip_org_key` for a server whose administrator lost it (a reinstall without
    zulip-secrets.conf). Zulip's own service verifies such a server through its hostname
    (`server/register/transfer`, not offered here: spec section 1); here the operator
    vouches for it, and the server keeps its UUID, realms and registrations."""
    key = args.key or _new_server_key()
    if len(key) != 64:
        return _fail("--key must be 64 characters", EXIT_USAGE)
    async with open_store(command_context) as (engine, _loaded), engine.begin() as conn:
        server = await repo.get_server(conn, args.server)
        if server is None:
            return _fail("no such server")
        if server.deactivated_at is not None:
            return _fail("the server is deactivated; it registers again under a new zulip_org_id")
        await repo.update_server(conn, server.id, key=key)
    print(f"replaced the key of {args.server} ({server.hostname})")
    if not args.key:
        _print_secrets(args.server, key)
    return 0


def cmd_keys_generate(args: argparse.Namespace, command_context: CommandContext) -> int:
    try:
        path = _keys_file(args, command_context)
    except KeyFileError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if path is None:
        return _fail(NO_KEYS_FILE, EXIT_USAGE)
    public, private = generate_bouncer_key()
    try:
        keys = _read_keys(path)
        keys[public] = private
        _write_keys(path, keys)
    except KeyFileError as exc:
        return _fail(str(exc))
    print(public)
    print(
        f"added to {path}; restart pushgw, then build the app with this public key",
        file=sys.stderr,
    )
    return 0


def cmd_keys_list(args: argparse.Namespace, command_context: CommandContext) -> int:
    if args.file:
        try:
            publics = list(load_bouncer_keys(_read_keys(Path(args.file))))
        except KeyFileError as exc:
            return _fail(str(exc))
        except CryptoError as exc:
            return _fail(f"{args.file}: {exc}")
    else:
        publics = list(_config(command_context.load()).bouncer_keys)
    for public in publics:
        print(public)
    return 0


def cmd_keys_remove(args: argparse.Namespace, command_context: CommandContext) -> int:
    try:
        path = _keys_file(args, command_context)
    except KeyFileError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if path is None:
        return _fail(NO_KEYS_FILE, EXIT_USAGE)
    try:
        keys = _read_keys(path)
        if args.public_key not in keys:
            return _fail("no such public key")
        del keys[args.public_key]
        _write_keys(path, keys)
    except KeyFileError as exc:
        return _fail(str(exc))
    print(f"removed {args.public_key}; restart pushgw to stop accepting it", file=sys.stderr)
    return 0


async def cmd_rehash_tokens(args: argparse.Namespace, command_context: CommandContext) -> int:
    """After a `receipts.hmac_key` rotation: registrations keep the hash of the key they
    were made under, which dead-token files of the new key's receipts never match
    (docs/receipts.md, "Rotating the HMAC key"). Idempotent; safe while serving."""
    async with open_store(command_context) as (engine, loaded):
        _config(loaded)  # the plugin disabled: one line, status 2 (its tables may not exist)
        async with engine.begin() as conn:
            changed = await repo.rehash_tokens(conn, loaded.contexts[PLUGIN].token_hash)
    print(f"rehashed {changed} registrations under the current receipts.hmac_key")
    return 0


async def cmd_gc(args: argparse.Namespace, command_context: CommandContext) -> int:
    async with open_store(command_context) as (engine, loaded):
        config = _config(loaded)
        try:
            older_than = (
                parse_duration(args.older_than) if args.older_than else config.gc_older_than
            )
        except ValueError as exc:
            return _fail(str(exc), EXIT_USAGE)
        counts = await collect(engine, older_than, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {counts.e2ee_expired} expired E2EE registrations")
    print(
        f"{verb} {counts.e2ee_of_gone_realms} E2EE and {counts.legacy_of_gone_realms} legacy "
        "registrations of deleted or deactivated realms"
    )
    print(
        f"{verb} {counts.e2ee_of_deactivated_servers} E2EE and "
        f"{counts.legacy_of_deactivated_servers} legacy registrations of deactivated servers"
    )
    return 0


_TOKEN_HASH = re.compile(r"[0-9a-f]{64}")


def _parse_token_id(text: str) -> int | None:
    """A `push_token_id` as the Zulip server stores it (a signed int64) or as the
    protocol carries it (8 bytes of base64); None when it is neither."""
    with contextlib.suppress(ValueError):
        value = int(text, 10)
        return value if -(2**63) <= value < 2**63 else None
    try:
        return token_id_to_int64(text)
    except CryptoError:
        return None


async def cmd_forget(args: argparse.Namespace, command_context: CommandContext) -> int:
    """Erase registrations at once, for a request that cannot wait for gc: the rows go
    (token in clear, hashes, dates), expired or not, and on SQLite the database files
    are checkpointed so that their bytes leave the disk too (docs/privacy.md). With
    `--server U --all`, the server itself goes too: its row and its realms."""
    realm_mode = args.realm is not None
    if realm_mode != (args.token_id is not None):
        return _fail("--realm and --token-id go together", EXIT_USAGE)
    user_given = args.user_id is not None or args.user_uuid is not None or args.all
    if (args.server is not None) != user_given:
        # `--server` alone is refused rather than read as the whole server: a dropped
        # `--user-id N` must not erase an organisation.
        return _fail("--server goes with --user-id, --user-uuid or --all", EXIT_USAGE)
    token_id = _parse_token_id(args.token_id) if realm_mode else None
    if realm_mode and token_id is None:
        return _fail("--token-id: not a push_token_id (a decimal int64 or base64)", EXIT_USAGE)
    if args.token_hash is not None and not _TOKEN_HASH.fullmatch(args.token_hash):
        # not echoed: it could be a device token in clear
        return _fail("--token-hash: must be 64 lowercase hex characters", EXIT_USAGE)
    user_id: int | None = None
    if args.user_id is not None:
        try:
            user_id = int(args.user_id, 10)
        except ValueError:
            return _fail("--user-id: not a whole number", EXIT_USAGE)
        if not -(2**63) <= user_id < 2**63:  # the column's BIGINT: the driver raised
            return _fail("--user-id: out of range (a Zulip user id is an int64)", EXIT_USAGE)
    async with command_context.open_store() as store:
        _config(command_context.load())  # the plugin disabled: one line, status 2
        async with store.engine.begin() as conn:
            outcome = await _forget_rows(conn, args, token_id, user_id)
        # Also after "no such server": the advice below is to run the command again, and
        # a server erased by the first run is no such server by the second.
        flushed = await store.checkpoint()
    if isinstance(outcome, str):
        status = _fail(outcome)
    else:
        e2ee, legacy, server_line = outcome
        print(f"deleted {e2ee} E2EE and {legacy} legacy registrations")
        if server_line:
            print(server_line)
        status = 0
    if not flushed:
        print(
            "pushgw zulip: warning: a reader kept the database's WAL file from being "
            "emptied: run the command again to take the deleted rows off the disk",
            file=sys.stderr,
        )
    return status


async def _forget_rows(
    conn: AsyncConnection, args: argparse.Namespace, token_id: int | None, user_id: int | None
) -> tuple[int, int, str | None] | str:
    """(E2EE rows, legacy rows, what else went) deleted, or why nothing could be."""
    if args.realm is not None:
        assert token_id is not None
        realm = await repo.get_realm(conn, args.realm)
        if realm is None:
            return "no such realm"
        return await repo.forget_e2ee_device(conn, realm.id, token_id), 0, None
    if args.server is not None:
        server = await repo.get_server(conn, args.server)
        if server is None:
            return "no such server"
        if args.all:
            erased = await repo.forget_server(conn, server.id)
            gone = f"deleted server {args.server} and its {erased.realms} realms"
            return erased.e2ee, erased.legacy, gone
        legacy = await repo.legacy_unregister_all(
            conn, server_id=server.id, user_id=user_id, user_uuid=args.user_uuid
        )
        return 0, legacy, None
    e2ee, legacy = await repo.forget_token_hash(conn, args.token_hash)
    return e2ee, legacy, None
