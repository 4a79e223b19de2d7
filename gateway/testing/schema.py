"""Schema drift: do the tables a plugin declares (`pushgw_tables`) match its migrations?

    async def test_my_tables_match_my_migrations(tmp_path):
        url = f"sqlite+aiosqlite:///{tmp_path / 'schema.db'}"
        assert await schema_drift(url, ["myplugin"]) == []

`schema_drift` migrates the database as the gateway does (the core's branch and the
given plugins' branches, every installed plugin's revisions known), then compares each
plugin's `MetaData`, and the core's, with what the migrations created, using Alembic's
autogenerate comparison (`compare_metadata`): tables, columns, types, nullability,
server defaults, indexes, unique constraints and foreign keys. It also checks the naming
rule: every table a plugin declares starts with `<plugin>_`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Index, MetaData, inspect
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql.elements import TextClause

from gateway.core.store import Store
from gateway.core.store import metadata as core_metadata
from gateway.plugins import PluginRegistry, installed_migration_dirs

CORE = "core"
CORE_PREFIX = "pushgw_"
VERSION_TABLE = "alembic_version"


async def schema_drift(
    url: str, plugins: Iterable[str] = (), *, extra_plugins: Mapping[str, object] | None = None
) -> list[str]:
    """The differences between the declared tables and the migrated database; [] if none.

    `url`: an empty database (its tables are compared after the migrations, so tables
    left there by other plugins would be reported as declared by no one). `plugins`
    are loaded by name as `plugins.enabled` lists them; `extra_plugins` registers plugin
    objects under a name, as `GatewayHarness` does. The core's table is always checked.
    Each difference is one line, starting with its owner (`core:`, `plugin 'name':`)
    when it has one.
    """
    registry = PluginRegistry(plugins, dict(extra_plugins or {}))
    owners: dict[str, MetaData] = {CORE: core_metadata}
    problems: list[str] = []
    for name in registry.names:
        declared = registry.call(name, "pushgw_tables")
        if declared is None and registry.call(name, "pushgw_migrations") is None:
            continue
        if declared is not None and not isinstance(declared, MetaData):
            kind = type(declared).__name__
            problems.append(f"plugin '{name}': pushgw_tables returned {kind}, not a MetaData")
            declared = None
        if declared is None:
            declared = MetaData()  # its migrations' tables are then reported as undeclared
        problems += [
            f"plugin '{name}': table '{table}' does not start with '{name}_'"
            for table in declared.tables
            if not table.startswith(f"{name}_")
        ]
        owners[name] = declared
    store = Store(url)
    try:
        await store.upgrade(registry.migration_dirs(), known=installed_migration_dirs())
        async with store.engine.connect() as conn:
            problems += await conn.run_sync(_compare, owners)
    finally:
        await store.close()
    return problems


def _compare(conn: Connection, owners: dict[str, MetaData]) -> list[str]:
    """Each owner's metadata against the tables that are its own; then the tables no
    owner declares nor names."""
    existing = set(inspect(conn).get_table_names()) - {VERSION_TABLE}
    owner_of = {table: _owner_by_prefix(table, owners) for table in existing}
    for owner, declared in owners.items():  # declared tables belong to their declarer
        owner_of.update(dict.fromkeys(declared.tables, owner))
    problems = []
    for owner, declared in owners.items():

        def own(name: str | None, type_: str, _parent: Any, owner: str = owner) -> bool:
            return type_ != "table" or owner_of.get(name or "") == owner

        context = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "compare_server_default": _compare_server_default,
                "include_name": own,
            },
        )
        label = CORE if owner == CORE else f"plugin '{owner}'"
        problems += [
            f"{label}: {_describe(d, conn.dialect)}"
            for d in _flat(compare_metadata(context, declared))
        ]
    problems += [
        f"table '{table}' is in the database but no plugin declares it or is named by it"
        for table in sorted(existing)
        if owner_of[table] is None
    ]
    return problems


def _owner_by_prefix(table: str, owners: Mapping[str, MetaData]) -> str | None:
    prefixes = {CORE_PREFIX: CORE, **{f"{n}_": n for n in owners if n != CORE}}
    matching = [p for p in prefixes if table.startswith(p)]
    return prefixes[max(matching, key=len)] if matching else None


_QUOTED = re.compile(r"^'(.*)'$", re.DOTALL)


def _compare_server_default(
    context: MigrationContext,
    _inspected_column: Any,
    _metadata_column: Any,
    inspected: str | None,
    _metadata_default: Any,
    rendered_metadata: str | None,
) -> bool | None:
    """SQLite reflects `DEFAULT ''` as `('')`, which Alembic's SQLite comparison does
    not unquote (it does for any non-empty string): the same default on both sides, as
    a literal string, is no difference. Anything else: Alembic's comparison (None)."""
    if context.dialect.name != "sqlite" or inspected is None or rendered_metadata is None:
        return None

    def bare(value: str) -> str:
        value = value[1:-1] if value.startswith("(") and value.endswith(")") else value
        quoted = _QUOTED.match(value)
        return quoted.group(1) if quoted else value

    return False if bare(inspected) == bare(rendered_metadata) else None


def _flat(diffs: list[Any]) -> list[tuple[Any, ...]]:
    """`compare_metadata` gives column changes as lists of tuples, the rest as tuples."""
    return [d for entry in diffs for d in (entry if isinstance(entry, list) else [entry])]


def _describe(diff: tuple[Any, ...], dialect: Dialect) -> str:
    """One difference in words. Tuple shapes: `alembic.autogenerate.compare_metadata`."""
    op = diff[0]
    side = "is declared but not in the database"
    if op.startswith("remove_"):
        side = "is in the database but not declared"
    if op in ("add_table", "remove_table"):
        return f"table '{diff[1].name}' {side}"
    if op in ("add_column", "remove_column"):
        return f"column '{diff[2]}.{diff[3].name}' {side}"
    if op in ("add_index", "remove_index", "add_constraint", "remove_constraint"):
        item = diff[1]
        kind = "index" if isinstance(item, Index) else _words(type(item).__name__)
        if getattr(item, "unique", False):
            kind = f"unique {kind}"
        columns = ", ".join(str(getattr(e, "name", e)) for e in _columns(item))
        named = f" '{item.name}'" if item.name else ""
        return f"{kind}{named} on {item.table.name}({columns}) {side}"
    if op in ("add_fk", "remove_fk"):
        fk = diff[1]
        columns = ", ".join(c.name for c in fk.columns)
        target = ", ".join(e.target_fullname for e in fk.elements)
        actions = "".join(
            f" ON {event} {action.upper()}"
            for event, action in (("DELETE", fk.ondelete), ("UPDATE", fk.onupdate))
            if action
        )
        return f"foreign key {fk.table.name}({columns}) -> {target}{actions} {side}"
    if op in _MODIFIED:
        _, _schema, table, column, _existing, in_database, declared = diff
        what, show = _MODIFIED[op]
        return (
            f"column '{table}.{column}': {what} {show(in_database, dialect)} in the database, "
            f"declared {show(declared, dialect)}"
        )
    return repr(diff)


def _words(name: str) -> str:
    """UniqueConstraint -> unique constraint."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def _columns(item: Any) -> list[Any]:
    return list(item.expressions) if isinstance(item, Index) else list(item.columns)


def _type(value: Any, dialect: Dialect) -> str:
    try:
        return str(value.compile(dialect=dialect))
    except Exception:
        return repr(value)


def _default(value: Any, dialect: Dialect) -> str:
    """A server default (a DefaultClause, or None) as SQL says it."""
    if value is None:
        return "none"
    arg = getattr(value, "arg", value)
    if isinstance(arg, TextClause):
        return arg.text
    if isinstance(arg, str):
        return repr(arg)
    try:
        return str(arg.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    except Exception:
        return repr(arg)


_MODIFIED: dict[str, tuple[str, Any]] = {
    "modify_type": ("type", _type),
    "modify_nullable": ("is", lambda value, _d: "NULL" if value else "NOT NULL"),
    "modify_default": ("server default", _default),
    "modify_comment": ("comment", lambda value, _d: repr(value)),
}


__all__ = ["schema_drift"]
