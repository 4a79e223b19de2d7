"""`schema_drift`: each plugin's declared tables (`pushgw_tables`) against its migrations."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Column, ForeignKey, Index, Integer, MetaData, String, Table

from gateway.api import hookimpl
from gateway.plugins import installed_plugins
from gateway.testing import schema_drift

BUILTINS = sorted(i.name for i in installed_plugins() if i.distribution == "pushgw")


def test_the_builtins_are_found() -> None:
    assert {"zulip", "matrix", "marmot"} <= set(BUILTINS)


async def test_the_core_alone_is_in_sync(store_url: str) -> None:
    assert await schema_drift(store_url) == []


async def test_every_builtin_plugin_is_in_sync(store_url: str) -> None:
    assert await schema_drift(store_url, BUILTINS) == []


async def test_the_third_party_sample_plugin_is_in_sync(
    sample_plugin_installed: str, store_url: str
) -> None:
    assert await schema_drift(store_url, [sample_plugin_installed]) == []


MIGRATION = """
import sqlalchemy as sa
from alembic import op

revision = "drifty_0001"
down_revision = None
branch_labels = ("drifty",)
depends_on = "core_0001"


def upgrade() -> None:
{body}
"""


class _Drifty:
    """A plugin whose tables are `metadata` and whose one revision runs `upgrade`."""

    def __init__(self, directory: Path, metadata: MetaData | None, upgrade: str) -> None:
        self.metadata = metadata
        self.directory = directory
        directory.mkdir()
        body = "\n".join(f"    {line}" for line in upgrade.strip().splitlines())
        (directory / "drifty_0001.py").write_text(MIGRATION.format(body=body))

    @hookimpl
    def pushgw_tables(self) -> MetaData | None:
        return self.metadata

    @hookimpl
    def pushgw_migrations(self) -> str:
        return str(self.directory)


def _items(*columns: Column[object], name: str = "drifty_items") -> MetaData:
    metadata = MetaData()
    Table(name, metadata, Column("id", Integer, primary_key=True), *columns)
    return metadata


CREATE_ITEMS = 'op.create_table("drifty_items", sa.Column("id", sa.Integer, primary_key=True)'

CASES = {
    "a declared column the migration does not create": (
        _items(Column("note", String(64))),
        CREATE_ITEMS + ")",
        ["plugin 'drifty': column 'drifty_items.note' is declared but not in the database"],
    ),
    "an index the migration creates and the metadata does not declare": (
        _items(Column("note", String(64))),
        CREATE_ITEMS + ', sa.Column("note", sa.String(64)))\n'
        'op.create_index("ix_drifty_items_note", "drifty_items", ["note"])',
        [
            "plugin 'drifty': index 'ix_drifty_items_note' on drifty_items(note) "
            "is in the database but not declared"
        ],
    ),
    "a column's type and nullability": (
        _items(Column("note", String(64), nullable=False)),
        CREATE_ITEMS + ', sa.Column("note", sa.String(32), nullable=True))',
        [
            "plugin 'drifty': column 'drifty_items.note': is NULL in the database, "
            "declared NOT NULL",
            "plugin 'drifty': column 'drifty_items.note': type VARCHAR(32) in the database, "
            "declared VARCHAR(64)",
        ],
    ),
    "a declared index the migration does not create": (
        _items(Column("note", String(64)), Index("ix_drifty_items_note", "note")),
        CREATE_ITEMS + ', sa.Column("note", sa.String(64)))',
        [
            "plugin 'drifty': index 'ix_drifty_items_note' on drifty_items(note) "
            "is declared but not in the database"
        ],
    ),
    "a declared unique constraint the migration does not create": (
        _items(Column("note", String(64), unique=True)),
        CREATE_ITEMS + ', sa.Column("note", sa.String(64)))',
        [
            "plugin 'drifty': unique constraint on drifty_items(note) "
            "is declared but not in the database"
        ],
    ),
    "a foreign key's ON DELETE": (
        _items(Column("parent_id", Integer, ForeignKey("drifty_items.id", ondelete="CASCADE"))),
        CREATE_ITEMS + ', sa.Column("parent_id", sa.Integer, sa.ForeignKey("drifty_items.id")))',
        [
            "plugin 'drifty': foreign key drifty_items(parent_id) -> drifty_items.id "
            "is in the database but not declared",
            "plugin 'drifty': foreign key drifty_items(parent_id) -> drifty_items.id "
            "ON DELETE CASCADE is declared but not in the database",
        ],
    ),
    "a server default only the migration has": (
        _items(Column("note", String(64), nullable=False, default="")),
        CREATE_ITEMS + ', sa.Column("note", sa.String(64), nullable=False, server_default="x"))',
        [
            "plugin 'drifty': column 'drifty_items.note': server default "
            "{x} in the database, declared none"
        ],
    ),
    "a table not named after the plugin": (
        _items(name="items"),
        CREATE_ITEMS.replace("drifty_items", "items") + ")",
        ["plugin 'drifty': table 'items' does not start with 'drifty_'"],
    ),
    "migrations without pushgw_tables": (
        None,
        CREATE_ITEMS + ")",
        ["plugin 'drifty': table 'drifty_items' is in the database but not declared"],
    ),
    "a table named after no plugin that no plugin declares": (
        _items(),
        CREATE_ITEMS + ')\nop.create_table("stray", sa.Column("id", sa.Integer, primary_key=True))',
        ["table 'stray' is in the database but no plugin declares it or is named by it"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_drift_is_reported_in_words(tmp_path: Path, store_url: str, case: str) -> None:
    metadata, upgrade, expected = CASES[case]
    plugin = _Drifty(tmp_path / "drifty_migrations", metadata, upgrade)
    drift = await schema_drift(store_url, ["drifty"], extra_plugins={"drifty": plugin})
    # a server default as the database spells it
    x = "'x'::character varying" if store_url.startswith("postgresql") else "'x'"
    assert sorted(drift) == sorted(line.format(x=x) for line in expected)


async def test_a_metadata_that_is_not_one_is_named(tmp_path: Path) -> None:
    plugin = _Drifty(tmp_path / "drifty_migrations", _items(), CREATE_ITEMS + ")")
    plugin.metadata = {"drifty_items": "?"}  # type: ignore[assignment]
    drift = await schema_drift(
        f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}",
        ["drifty"],
        extra_plugins={"drifty": plugin},
    )
    assert drift == [
        "plugin 'drifty': pushgw_tables returned dict, not a MetaData",
        "plugin 'drifty': table 'drifty_items' is in the database but not declared",
    ]
