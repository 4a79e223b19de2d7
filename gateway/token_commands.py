"""`pushgw tokens ...`: device tokens seen from the command line (docs/cli.md).

- `retire FILE` feeds a dead-token file (Spark's `dead-tokens` job) through the one
  invalidation path a live provider failure takes;
- `hash [TOKEN]` prints the keyed hash receipts carry for a token, for support;
- `status HASH ...` prints a hash's dead-token records: whether, when and why retired.

The parser and the error handling are `gateway.cli`'s; this module holds the commands.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.cli import (
    EXIT_FAILED,
    DatabaseError,
    UsageError,
    no_config_note,
    opened_store,
    shown_url,
)

if TYPE_CHECKING:
    from gateway.context import CommandContext
    from gateway.dead_tokens import DeadToken


async def cmd_tokens_retire(args: argparse.Namespace, context: CommandContext) -> int:
    """Feed a dead-token file (spark `dead-tokens` job) through the one invalidation path.

    The whole file is read and checked first: a bad line retires nothing (exit 2).
    Tokens of plugins not enabled or apps not configured here are skipped and counted
    (one dead-token file covers every gateway node's receipts). What could not be
    applied (database or plugin hook failure) is named by file:line, and exit status is 1.
    """
    from gateway.core.push import InvalidToken
    from gateway.dead_tokens import DeadTokenFileError, read_dead_tokens

    path = Path(args.file)
    try:
        tokens, duplicates = read_dead_tokens(path)
    except DeadTokenFileError as exc:
        raise UsageError(str(exc)) from None
    loaded = context.load()
    no_config_note(args, loaded)
    todo: list[DeadToken] = []
    skipped: Counter[tuple[str, str]] = Counter()
    for token in tokens:
        if token.plugin not in loaded.contexts:
            skipped[(token.plugin, "")] += 1
        elif (token.plugin, token.app_id) not in loaded.apps:
            skipped[(token.plugin, token.app_id)] += 1
        else:
            todo.append(token)
    for (plugin, app_id), count in sorted(skipped.items()):
        what = (
            f"app {plugin}/{app_id}: not an app of this configuration"
            if app_id
            else f"plugin {plugin}: not enabled in this configuration"
        )
        print(f"pushgw: skipped {_tokens(count)} of {what}", file=sys.stderr)
    counts = _skip_counts(skipped, duplicates)
    if not todo:
        print(f"retired 0 tokens (nothing to apply: database not opened){counts}")
        return 0

    retired = 0
    unmatched = 0  # retired, but the plugin found no record of the hash
    failures: list[str] = []
    async with opened_store(loaded, migrate=loaded.settings.store.auto_upgrade) as store:
        invalidation = loaded.invalidation
        assert invalidation is not None
        for token in todo:
            outcome = await invalidation.handle(
                InvalidToken(
                    plugin=token.plugin,
                    app_id=token.app_id,
                    token_hash=token.token_hash,
                    token=None,
                    provider=token.provider,
                    reason=token.reason,
                    # registrations made after the receipts the file was made from stay
                    observed_at=token.last_seen,
                )
            )
            if not outcome.handled:  # the same token was handled a line before
                duplicates += 1
                continue
            if outcome.complete:
                retired += 1
                unmatched += outcome.found == 0
                continue
            hook = f"the {token.plugin} plugin's token-invalid hook"
            if outcome.record_error and outcome.hook_error:
                problem = (
                    f"hash not recorded ({outcome.record_error}) "
                    f"and {hook} failed ({outcome.hook_error})"
                )
            elif outcome.record_error:
                problem = f"hash not recorded ({outcome.record_error}); {hook} ran"
            else:
                problem = f"{hook} failed ({outcome.hook_error}); the hash was recorded"
            failures.append(f"{path}:{token.line}: not retired: {problem}")
        where = shown_url(store.url)
    counts = _skip_counts(skipped, duplicates)
    for line in failures[:_MAX_FAILURE_LINES]:
        print(f"pushgw: {line}", file=sys.stderr)
    if len(failures) > _MAX_FAILURE_LINES:
        more = len(failures) - _MAX_FAILURE_LINES
        print(f"pushgw: ... and {more} more not retired", file=sys.stderr)
    failed = f"; {len(failures)} not retired (see above)" if failures else ""
    if unmatched:
        print(
            f"pushgw: {_tokens(unmatched)} matched no registration of their plugin: "
            "forgotten already, or hashed under another receipts.hmac_key than this "
            "configuration's (docs/receipts.md, rotating the HMAC key)",
            file=sys.stderr,
        )
        counts += f"; {unmatched} matched no registration"
    print(f"retired {_tokens(retired)} in {where}{counts}{failed}")
    return EXIT_FAILED if failures else 0


_MAX_FAILURE_LINES = 20


ARGUMENT_TOKEN_WARNING = (
    "pushgw: warning: a token given as an argument stays in the shell's history and "
    "shows in `ps`: give it on stdin instead (`pushgw tokens hash < token.txt`)"
)


def cmd_tokens_hash(args: argparse.Namespace, context: CommandContext) -> int:
    """Print the keyed hash receipts carry for each device token given (docs/cli.md).

    A support engineer has a user's token, the receipts have only its hash: this is the
    one way from the first to the second, under the configured `receipts.hmac_key`, so
    that nobody hand-rolls an HMAC (or pastes the token and the key into a web page).
    The tokens are read before the configuration, and never printed back.
    """
    if args.token not in (None, "-"):
        print(ARGUMENT_TOKEN_WARNING, file=sys.stderr)
        tokens = [args.token.strip()]
    else:
        tokens = _stdin_tokens()
    if not all(tokens):
        raise UsageError("no token given: pipe one token per line on stdin")
    loaded = context.load()
    no_config_note(args, loaded)
    from gateway.config.sections import DEVELOPMENT_HMAC_KEY

    if loaded.settings.receipts.hmac_key.get_secret_value() == DEVELOPMENT_HMAC_KEY:
        print(
            "pushgw: warning: receipts.hmac_key is not set: this is the hash under the public "
            "development key, which matches only receipts of a gateway that ran without a key",
            file=sys.stderr,
        )
    for token in tokens:
        print(loaded.runtime.hasher(token))
    return 0


async def cmd_tokens_status(args: argparse.Namespace, context: CommandContext) -> int:
    """Print the dead-token records (`pushgw_invalid_tokens`) of the given hashes, one
    JSON object a line: whether, when and why a device's token was retired (docs/cli.md).
    """
    from sqlalchemy import select

    from gateway.core.store import invalid_tokens

    hashes = [_token_hash_argument(text) for text in args.hashes]
    loaded = context.load()
    no_config_note(args, loaded)
    _require_sqlite_file(loaded.settings.store.url)
    async with context.open_store() as store, store.engine.connect() as conn:
        query = (
            select(invalid_tokens)
            .where(invalid_tokens.c.token_hash.in_(hashes))
            .order_by(invalid_tokens.c.invalidated_at)
        )
        rows = (await conn.execute(query)).mappings().all()
    for row in rows:
        record = dict(row)
        record["invalidated_at"] = _utc_iso(row["invalidated_at"])
        print(json.dumps(record))
    found = {row["token_hash"] for row in rows}
    days = loaded.settings.store.invalid_tokens_retention / 86400
    for number, value in enumerate(hashes, 1):
        if value not in found:  # named by position: a hex APNs token looks like a hash
            print(
                f"pushgw: HASH {number}: no dead-token record: not retired in the last "
                f"{days:g} days (store.invalid_tokens_retention), or hashed under another "
                "receipts.hmac_key",
                file=sys.stderr,
            )
    return 0


def _require_sqlite_file(url: str) -> None:
    """A lookup makes no database: opening a SQLite file that is not there created (and
    migrated) an empty one, in the working directory without `-c`, whose answer was
    "not retired" for every hash."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:  # `open_store` says what is wrong with it
        return
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    if not Path(parsed.database).exists():
        raise DatabaseError(
            f"database {shown_url(url)}: no such database: give the configuration "
            "the gateway runs with (-c FILE)"
        )


def _token_hash_argument(text: str) -> str:
    """A receipts `token_hash` (hex, either case): else a usage error that does not
    echo it (it could be the token itself)."""
    from gateway.dead_tokens import TOKEN_HASH

    value = text.strip().lower()
    if not re.fullmatch(TOKEN_HASH, value):
        raise UsageError(
            "not a token hash (64 hex characters, the receipts' token_hash); "
            "`pushgw tokens hash` makes one from a token"
        )
    return value


def _utc_iso(value: Any) -> str:
    """A stored time as ISO 8601 UTC (SQLite gives it back without its zone)."""
    import datetime as dt

    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return str(value.astimezone(dt.UTC).isoformat(timespec="seconds"))


def _stdin_tokens() -> list[str]:
    """The non-empty lines of stdin, stripped; from a terminal, one token, not echoed."""
    if sys.stdin is None:
        return []
    if sys.stdin.isatty():
        import getpass

        return [getpass.getpass("device token (not shown): ", stream=sys.stderr).strip()]
    try:
        # `-sig`: a byte order mark (Notepad's "UTF-8") is no part of the token, and
        # hashed with it gave a hash that no receipt carries.
        text = sys.stdin.buffer.read().decode("utf-8-sig")
    except UnicodeDecodeError:  # its bytes are not shown: they may be a token
        raise UsageError("stdin: not UTF-8 text") from None
    return [line.strip() for line in text.splitlines() if line.strip()] or [""]


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def _skip_counts(skipped: Counter[tuple[str, str]], duplicates: int) -> str:
    plugins = sum(n for (_, app_id), n in skipped.items() if not app_id)
    apps = sum(n for (_, app_id), n in skipped.items() if app_id)
    parts = [
        f"{plugins} of plugins not enabled" if plugins else "",
        f"{apps} of apps not configured" if apps else "",
        f"{duplicates} duplicate lines" if duplicates else "",
    ]
    shown = ", ".join(p for p in parts if p)
    return f"; skipped {shown}" if shown else ""
