"""Persistence: SQLAlchemy 2 async over SQLite (embedded default) or PostgreSQL.

The core owns one table (`pushgw_invalid_tokens`); plugins own theirs, declared
through the `pushgw_tables` / `pushgw_migrations` hooks. Schema changes are Alembic
revisions only: the core's base branch plus one branch per plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from alembic.util import CommandError, to_tuple
from sqlalchemy import Column, DateTime, Index, MetaData, String, Table, event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
CORE_BRANCH = "core"
PING_TIMEOUT = 5.0  # seconds /readyz waits for the database
# PostgreSQL advisory lock key that serialises migrations of one database by several
# gateway processes (migrations/env.py): the first 8 bytes of sha256(b"pushgw migrations").
MIGRATION_LOCK = int.from_bytes(hashlib.sha256(b"pushgw migrations").digest()[:8], signed=True)

metadata = MetaData()

invalid_tokens = Table(
    "pushgw_invalid_tokens",
    metadata,
    Column("plugin", String(64), primary_key=True),
    Column("app_id", String(255), primary_key=True),
    Column("token_hash", String(64), primary_key=True),
    Column("provider", String(8), nullable=True),
    Column("reason", String(64), nullable=True),
    Column("invalidated_at", DateTime(timezone=True), nullable=False),
    # the sweep's `invalidated_at < cutoff` (migration core_0002)
    Index("ix_pushgw_invalid_tokens_invalidated_at", "invalidated_at"),
)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    # Erasure (docs/privacy.md): a deleted row's bytes (a device token in clear) are
    # overwritten with zeros instead of left in a free page of the file, whatever the
    # build's default (Debian's SQLite zeroes them, most others do not); and the WAL
    # file is cut back after each checkpoint instead of keeping old frames, which hold
    # the rows as they were before the delete, until they happen to be overwritten.
    cursor.execute("PRAGMA secure_delete=ON")
    cursor.execute("PRAGMA journal_size_limit=0")
    cursor.close()


def _begin_before_savepoint(conn: Connection, _name: str) -> None:
    """BEGIN before a SAVEPOINT that would otherwise open the transaction (SQLite).

    sqlite3 (and aiosqlite over it) emits its implicit BEGIN only before INSERT, UPDATE
    and DELETE. A SAVEPOINT coming first (an insert that may lose a uniqueness race,
    before any other write) opened a transaction of its own, and its release committed
    it: a failure later in the enclosing transaction no longer undid that insert, as it
    does on PostgreSQL. This is the BEGIN sqlite3 would have emitted before the INSERT;
    the reads before it stay outside the transaction as before: a BEGIN at the start of
    every transaction (SQLAlchemy's recipe) makes read-then-write transactions fail at
    once with `database is locked` under concurrent writers (WAL: a transaction that read
    before another connection's commit cannot write), instead of waiting the busy timeout.
    """
    driver = conn.connection.driver_connection  # sqlite3's or aiosqlite's connection
    if driver is not None and not driver.in_transaction:
        conn.exec_driver_sql("BEGIN")


def create_engine(url: str, pool_size: int = 10) -> AsyncEngine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        event.listen(engine.sync_engine, "savepoint", _begin_before_savepoint)
        return engine
    return create_async_engine(url, pool_size=pool_size, pool_pre_ping=True)


# What an operator should check for a PostgreSQL error, by SQLSTATE, then by its class
# (the first two characters): the policies a production server enforces on its clients.
_ADVICE = {
    "25006": "the database is read-only (a switchover in progress, or "
    "default_transaction_read_only): writes fail until it is writable again",
    "57014": "a statement was cancelled (statement_timeout, pg_cancel_backend): check the "
    "timeout set for pushgw's role and the locks held on its tables",
    "25P03": "idle_in_transaction_session_timeout ended the connection",
    "53300": "no connection slot left (max_connections, or the role's CONNECTION LIMIT): "
    "size store.pool_size against it (docs/configuration.md)",
    "42501": "pushgw's role lacks a privilege: grant it USAGE on the schema and SELECT, "
    "INSERT, UPDATE, DELETE on the tables and sequences of its migrations",
    "42P01": "a table is missing: run `pushgw db upgrade`, and check that the role's "
    "search_path names the schema holding pushgw's tables",
    "57P01": "an administrator or a failover ended the connection (pg_terminate_backend)",
    "57P03": "the server is starting, stopping or recovering",
    "08": "the connection to the database failed (a restart, a failover, the network)",
    "53": "the database server is out of resources (disk, memory, connections)",
    "40": "the transaction conflicted with another (deadlock, serialization failure)",
}


def database_problem(exc: BaseException) -> str | None:
    """One line for the operator's log saying what a database error is and what to check;
    None when `exc` is not a database error.

    Never the driver's message for PostgreSQL: asyncpg's may quote a statement's
    parameters (a device token). The error's kind and SQLSTATE say as much, and the
    advice says what to do. SQLite's messages are fixed texts and are kept.
    """
    if not isinstance(exc, DBAPIError):
        return None
    orig = exc.orig if exc.orig is not None else exc
    cause = orig.__cause__ if isinstance(orig.__cause__, Exception) else orig
    kind = type(cause).__name__
    code = getattr(orig, "sqlstate", None) or getattr(cause, "sqlstate", None)
    if code is None:
        if exc.connection_invalidated or isinstance(cause, OSError):
            return f"{kind}: {_ADVICE['08']}"
        text = str(orig).strip().splitlines() if orig.__module__.startswith("sqlite3") else []
        return f"{kind}: {text[0]}" if text else kind
    advice = _ADVICE.get(code) or _ADVICE.get(code[:2])
    return f"{kind} (SQLSTATE {code})" + (f": {advice}" if advice else "")


class Store:
    """The gateway's database handle, given to plugins as `context.store`."""

    def __init__(self, url: str, pool_size: int = 10) -> None:
        self.url = url
        self.engine = create_engine(url, pool_size)
        self.sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(
            self.engine, expire_on_commit=False
        )

    # For plugins (through `context.store`): their log line for a failed request.
    problem = staticmethod(database_problem)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def ping(self, timeout: float = PING_TIMEOUT) -> bool:
        """True when the database answers within `timeout` s (used by /readyz).

        Bounded: a database host that takes connections and never answers (a network
        partition, a stopped VM) made asyncpg wait its 60 s connect timeout, and every
        readiness probe meanwhile piled up another waiting connection attempt.
        """
        try:
            async with asyncio.timeout(timeout), self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    async def checkpoint(self, *, truncate: bool = True) -> bool:
        """Put what was deleted out of the database files (erasure, docs/privacy.md).

        SQLite in WAL mode writes a delete to the `-wal` file first; the database file
        keeps the row until the next checkpoint (every 1000 pages of writes, or when the
        last connection closes), and the `-wal` file keeps its earlier frames until it
        is reset. With `truncate`, this checkpoints and empties it at once
        (`wal_checkpoint(TRUNCATE)`, which waits for readers and holds writers back
        meanwhile: for commands); without, it checkpoints what no reader needs and the
        `-wal` file is cut back at the next write (`PASSIVE`: for a running gateway).
        False when a reader kept it from completing (run it again). PostgreSQL: nothing
        to do here (autovacuum reclaims deleted rows); True.
        """
        if self.dialect != "sqlite":
            return True
        mode = "TRUNCATE" if truncate else "PASSIVE"
        async with self.engine.connect() as conn:
            row = (await conn.exec_driver_sql(f"PRAGMA wal_checkpoint({mode})")).first()
        return row is not None and row[0] == 0

    async def upgrade(
        self, version_locations: Sequence[str] = (), known: Sequence[str] = ()
    ) -> None:
        """Apply the core's branch and the given plugin directories' to their heads.

        `known`: other plugins' directories (installed, not enabled), only to locate
        revisions the database holds: a plugin disabled after its branch was applied
        leaves its revision there, which Alembic must find to upgrade anything.
        """
        await self._migrate(lambda: upgrade(self.url, version_locations, known))

    async def downgrade(
        self, targets: Sequence[str], version_locations: Sequence[str]
    ) -> list[str]:
        """Undo the revisions above each of `targets` in its branch (`downgrade`); returns
        the database's revisions after."""
        heads: list[str] = []
        await self._migrate(lambda: heads.extend(downgrade(self.url, targets, version_locations)))
        return heads

    async def _migrate(self, migrate: Callable[[], object]) -> None:
        # In a daemon thread, not asyncio's executor: that one is waited for on the way
        # out, so Ctrl-C while the migration waits (for another process's migration lock,
        # a database that does not answer) would not end the command until the wait did.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if done.done():  # cancelled (Ctrl-C)
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        def run() -> None:
            error: BaseException | None = None
            try:
                migrate()
            except BaseException as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, error)

        threading.Thread(target=run, name="pushgw-migrate", daemon=True).start()
        await done

    async def close(self) -> None:
        await self.engine.dispose()


def alembic_config(url: str, version_locations: Sequence[str] = ()) -> AlembicConfig:
    # The directories lie wherever pushgw is installed (`/opt/Push Gateway/venv/...`):
    # split on os.pathsep, not on spaces (a location cut in two is silently skipped, and
    # its revisions with it), and `%` escaped (the options are ConfigParser values).
    # `version_path_separator` is what Alembic before 1.16 reads.
    def option(value: object) -> str:
        return str(value).replace("%", "%%")

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", option(MIGRATIONS_DIR))
    locations = [str(MIGRATIONS_DIR / "versions"), *map(str, version_locations)]
    cfg.set_main_option("version_locations", option(os.pathsep.join(locations)))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_path_separator", "os")
    cfg.attributes["url"] = url
    return cfg


class MigrationRefused(Exception):
    """A migration not attempted; the message (one line) says why and what to do."""


class UnknownRevisions(MigrationRefused):
    """The database holds revisions this pushgw cannot locate: a newer pushgw migrated
    it, or the plugin they belong to is no longer installed."""

    def __init__(self, unknown: Sequence[str], heads: Sequence[str]) -> None:
        super().__init__(
            f"at revision {', '.join(unknown)}, which this pushgw does not know: a newer "
            "pushgw migrated it (roll it back with that one: "
            f"`pushgw db downgrade {' '.join(heads)}`, docs/cli.md), or the plugin of that "
            "revision is no longer installed (docs/plugins.md)"
        )


def check_known(script: ScriptDirectory, current: Sequence[str], heads: Sequence[str]) -> None:
    """Raise UnknownRevisions when the database (at `current`) holds a revision `script`
    cannot locate, naming `heads`, this pushgw's own: Alembic's own error (`Can't locate
    revision`) said neither why nor what to do, and a node of an older release sharing
    the database of a newer one must say both."""
    unknown = [rev for rev in current if _revision(script, rev) is None]
    if unknown:
        raise UnknownRevisions(sorted(unknown), heads)


def upgrade(url: str, version_locations: Sequence[str] = (), known: Sequence[str] = ()) -> None:
    """Synchronous entry point (Alembic's command API is synchronous)."""
    extra = [d for d in known if d not in version_locations]
    cfg = alembic_config(url, [*version_locations, *extra])
    heads = branch_heads(cfg, version_locations)
    cfg.attributes["heads"] = heads  # checked by env.py against the database's (check_known)
    with sqlite_migration_lock(url):
        for head in heads:
            command.upgrade(cfg, head)


def downgrade(url: str, targets: Sequence[str], version_locations: Sequence[str]) -> list[str]:
    """Bring each branch holding one of `targets` (revision ids) down to it; a branch with
    nothing above it applied is left alone, so the heads of an older release can be given
    whole (`core_0001 zulip_0003`: Alembic refuses `core_0001` itself while a plugin's
    revisions depending on it are applied). Returns the database's revisions after."""
    cfg = alembic_config(url, version_locations)
    script = ScriptDirectory.from_config(cfg)
    for target in targets:
        # `base`, `zulip@base`, `-1`: not a release's revision, and they drop tables
        if _revision(script, target) is None:
            raise MigrationRefused(
                f"{target!r} is not a revision of this pushgw: give those of the release "
                "to roll back to (its refusal to start names them)"
            )
    with sqlite_migration_lock(url):
        # revisions this pushgw does not know: an even newer one must undo them
        check_known(script, current_heads(url), targets)
        for target in targets:
            if any(_above(script, rev, target) for rev in current_heads(url)):
                command.downgrade(cfg, target)
        return sorted(current_heads(url))


def _revision(script: ScriptDirectory, revision: str) -> Script | None:
    """The script of exactly this revision id, or None (not `base`, a prefix, ...)."""
    try:
        found = script.get_revision(revision)
    except CommandError:
        return None
    return found if found is not None and found.revision == revision else None


def _above(script: ScriptDirectory, revision: str, target: str) -> bool:
    """Whether `target` lies below `revision` in its branch (down_revision, not
    depends_on)."""
    seen: set[str] = set()
    todo = [revision]
    while todo:
        rev = _revision(script, todo.pop())
        if rev is None or rev.revision in seen:
            continue
        seen.add(rev.revision)
        downs = to_tuple(rev.down_revision, default=())
        if target in downs:
            return True
        todo.extend(downs)
    return False


def current_heads(url: str) -> list[str]:
    """The revisions the database is at (synchronous: from a thread without a loop)."""

    async def read() -> list[str]:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return list(
                    await conn.run_sync(
                        lambda sync: MigrationContext.configure(sync).get_current_heads()
                    )
                )
        finally:
            await engine.dispose()

    return asyncio.run(read())


def migration_lock_path(url: str) -> Path | None:
    """The file that serialises migrations of a SQLite database file; None for an
    in-memory database or another dialect (PostgreSQL: an advisory lock, env.py)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(f"{parsed.database}.migrate-lock")


@contextlib.contextmanager
def sqlite_migration_lock(url: str) -> Iterator[None]:
    """Held while the migrations of a SQLite database run: `pushgw serve` and a command
    with `store.auto_upgrade` (a cron `tokens retire`, say) starting together on a new
    database both created the tables, and one failed (`table ... already exists`).

    An exclusive `flock` on a file next to the database, waited for as long as the
    other's migrations take (SQLite's own busy timeout would give up after 5 s); the
    one who comes second finds the database at head.
    """
    path = migration_lock_path(url)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def branch_heads(cfg: AlembicConfig, version_locations: Sequence[str]) -> list[str]:
    """The heads of the core's branch and of the branches in `version_locations`, not
    of the other directories `cfg` knows (plugins not enabled: left as they are)."""
    wanted = {
        (MIGRATIONS_DIR / "versions").resolve(),
        *(Path(d).resolve() for d in version_locations),
    }
    script = ScriptDirectory.from_config(cfg)
    heads = []
    for head in script.get_heads():
        revision = script.get_revision(head)
        if revision is not None and Path(revision.path).parent.resolve() in wanted:
            heads.append(head)
    return sorted(heads)


class BackupRefused(Exception):
    """`sqlite_backup` not attempted; the message (one line) says why."""


def sqlite_backup(url: str, dest: Path) -> list[str]:
    """Copy the SQLite database of `url` into the new file `dest`; returns its revisions.

    `VACUUM INTO`: one read transaction, so the copy is a consistent snapshot even while
    `pushgw serve` writes (WAL: readers and the writer do not block each other), and one
    file (a copy of the database file alone misses what is still in its `-wal`). Written
    under a temporary name next to `dest` and linked to `dest` when complete, so `dest` is
    never a half-written file. A database file that is missing is refused, not created.

    The copy holds what the database holds (Zulip device tokens in clear), in a directory
    others may share (`/tmp`, a backup mount), so: the temporary file is a new one made
    here (`mkstemp`: a random name, `O_EXCL`, never a symlink another user left there for
    SQLite to follow), as readable as the database file and no more (umask 022 made
    every copy world-readable); and `dest` is linked, never renamed over, so a file or
    symlink that appeared there since the caller's check is `FileExistsError`, not
    replaced. Where the file system has no hard links (FAT, some network mounts) it is
    renamed after one more check.
    """
    import sqlite3
    import stat
    import tempfile
    import urllib.parse

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        raise BackupRefused("not a SQLite database file: back PostgreSQL up with pg_dump")
    source = Path(parsed.database or "")
    if not source.is_file():
        raise BackupRefused("no such database file: nothing to back up")
    mode = stat.S_IMODE(source.stat().st_mode) & 0o666
    conn = sqlite3.connect(
        f"file:{urllib.parse.quote(str(source))}?mode=rw", uri=True, timeout=30.0
    )
    partial: Path | None = None
    try:
        tables = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"
        ).fetchall()
        if not tables:
            raise BackupRefused("not a pushgw database (no alembic_version table)")
        revisions = sorted(
            row[0] for row in conn.execute("SELECT version_num FROM alembic_version")
        )
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.partial-", dir=dest.parent)
        partial = Path(name)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        conn.execute("VACUUM INTO ?", (str(partial),))  # an empty file: SQLite fills it
        try:
            os.link(partial, dest, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError:  # no hard links here
            if os.path.lexists(dest):
                raise FileExistsError(errno.EEXIST, "File exists", str(dest)) from None
            os.replace(partial, dest)
    finally:
        conn.close()
        if partial is not None:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
    return revisions
