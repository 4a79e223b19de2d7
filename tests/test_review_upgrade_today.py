"""Upgrading a running gateway from this morning's commit (f3e3be5) to today's, from an
operator's seat.

Yesterday's state is made by yesterday's code: `git archive f3e3be5` into a scratch
directory, and its own modules write the credentials, a config and a SQLite database
(the core and Zulip branches migrated, servers, realms, registrations and dead-token
records inserted by its repository functions). Today's code then opens that database
with no migration, and `pushgw check-config` refuses the configs that today's rules
refuse, each with one line saying which key to change and to what. Where the checkout
has no history (a shallow clone, an sdist) those tests are skipped; the others build
what they need with today's code.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from gateway.core.metrics import Metrics
from gateway.core.store import Store

ROOT = Path(__file__).resolve().parent.parent
YESTERDAY = "f3e3be5"
APNS_TOPIC = "com.example.ios"

# What f3e3be5 wrote: run in a subprocess with only yesterday's tree on sys.path.
MAKE_STATE = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path

    import yaml

    sys.path.insert(0, str(Path(sys.argv[1]) / "bench"))
    import sizing
    from gateway.testing.apns_sim import generate_apns_auth_key
    from gateway.testing.fcm_sim import make_service_account

    state = Path(sys.argv[2])
    generate_apns_auth_key("KEY0000001", "TEAM000001").write_p8(state / "key.p8")
    make_service_account("proj", "https://oauth2.googleapis.com/token", state / "sa.json")
    (state / "marmot.key").write_text("11" * 32 + "\\n")
    (state / "marmot.key").chmod(0o600)
    apns = {
        "type": "apns",
        "keyfile": str(state / "key.p8"),
        "key_id": "KEY0000001",
        "team_id": "TEAM000001",
        "topic": "com.example.ios",
    }
    url = f"sqlite+aiosqlite:///{state}/pushgw.db"
    config = {
        "store": {"url": url},
        "receipts": {"directory": str(state / "receipts"), "hmac_key": "yesterday-" * 3},
        "plugins": {
            "enabled": ["zulip", "matrix", "marmot"],
            "zulip": {"apps": {"com.example.ios": dict(apns)}},
            "matrix": {"apps": {"com.example.ios": dict(apns)}},
            "marmot": {
                "server_secret_key_file": str(state / "marmot.key"),
                "inbox_relays": ["ws://127.0.0.1:6969"],
                "apps": {"com.example.ios": dict(apns)},
                "apns": {"app": "com.example.ios"},
            },
        },
    }
    (state / "pushgw.yaml").write_text(yaml.safe_dump(config))
    asyncio.run(sizing.database_bytes(url, 5))
    """
)


def _pushgw(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=pythonpath or ROOT,
    )


@pytest.fixture(scope="module")
def yesterday(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(yesterday's source tree, the state directory its code wrote)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("no git to take f3e3be5's tree from")
    found = subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "-e", f"{YESTERDAY}^{{commit}}"],
        capture_output=True,
    )
    if found.returncode != 0:
        pytest.skip(f"the checkout does not hold {YESTERDAY} (a shallow clone?)")
    base = tmp_path_factory.mktemp("upgrade_today")
    old, state = base / "old", base / "state"
    state.mkdir()
    archive = base / "old.tar"
    with archive.open("wb") as out:
        subprocess.run(
            [git, "-C", str(ROOT), "archive", YESTERDAY], stdout=out, check=True, timeout=120
        )
    with tarfile.open(archive) as tar:
        tar.extractall(old, filter="data")
    script = base / "make_state.py"
    script.write_text(MAKE_STATE)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    env["PYTHONPATH"] = str(old)
    made = subprocess.run(
        [sys.executable, str(script), str(old), str(state)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=old,
    )
    assert made.returncode == 0, made.stderr
    yield old, state


def _revisions(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return sorted(row[0] for row in conn.execute("SELECT version_num FROM alembic_version"))


def test_yesterdays_database_needs_no_migration(yesterday: tuple[Path, Path]) -> None:
    old, state = yesterday
    config = str(state / "pushgw.yaml")
    db = state / "pushgw.db"
    before = _revisions(db)
    assert before == ["core_0002", "zulip_0004"]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        e2ee = conn.execute("SELECT count(*) FROM zulip_e2ee_devices").fetchone()[0]
        token_hash = conn.execute("SELECT token_hash FROM zulip_e2ee_devices").fetchone()[0]
    assert e2ee == 10

    upgraded = _pushgw("--config", config, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert "database at head (sqlite)" in upgraded.stdout
    assert _revisions(db) == before
    checked = _pushgw("check-config", "--config", config)
    assert checked.returncode == 0, checked.stderr

    # Today's erasure works on yesterday's rows, with today's pragmas on its connections.
    forgot = _pushgw("--config", config, "zulip", "forget", "--token-hash", token_hash)
    assert forgot.returncode == 0, forgot.stderr
    assert "deleted 1 E2EE" in forgot.stdout
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT count(*) FROM zulip_e2ee_devices").fetchone()[0] == e2ee - 1

    # ... and yesterday's code still takes the database (a rollback of the software).
    back = _pushgw("--config", config, "db", "upgrade", pythonpath=old)
    assert back.returncode == 0, back.stderr
    assert _revisions(db) == before


def _variant(state: Path, name: str, change: Any) -> Path:
    config = yaml.safe_load((state / "pushgw.yaml").read_text())
    config = copy.deepcopy(config)
    change(config["plugins"])
    path = state / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fcm_app(state: Path, options: dict[str, Any]) -> Any:
    def change(plugins: dict[str, Any]) -> None:
        plugins["matrix"]["apps"]["com.example.android"] = {
            "type": "gcm",
            "api_version": "v1",
            "project_id": "proj",
            "service_account_file": str(state / "sa.json"),
            "fcm_options": options,
        }

    return change


def _set(plugin: str, **values: Any) -> Any:
    def change(plugins: dict[str, Any]) -> None:
        plugins[plugin]["apps"][APNS_TOPIC].update(values)

    return change


# (name, change to yesterday's config, what today's one line must say)
REFUSED = [
    (
        "voip_without_its_topic",
        lambda state: _set("zulip", push_type="voip"),
        [
            "plugins.zulip.apps.com.example.ios: push_type voip needs a topic ending in .voip",
            f"set topic {APNS_TOPIC}.voip for a voip app, or leave push_type unset",
        ],
    ),
    (
        "marmot_voip_topic",
        lambda state: _set("marmot", topic=APNS_TOPIC + ".voip"),
        [
            "plugins.marmot: apns.app: app 'com.example.ios' takes only voip pushes",
            "use the app's bundle id as topic and leave push_type unset",
        ],
    ),
    (
        "matrix_numeric_ttl",
        lambda state: _fcm_app(state, {"android": {"ttl": 3600}}),
        [
            "plugins.matrix.apps.com.example.android: fcm_options: FCM android.ttl",
            '"3600s"',
        ],
    ),
    (
        "matrix_legacy_field",
        lambda state: _fcm_app(state, {"time_to_live": 3600}),
        [
            "plugins.matrix.apps.com.example.android: fcm_options: FCM message field "
            "'time_to_live' is the legacy API's; in HTTP v1 it is android.ttl",
        ],
    ),
]


@pytest.mark.parametrize(("name", "change", "says"), REFUSED, ids=[r[0] for r in REFUSED])
def test_configs_valid_yesterday_are_refused_at_check_config_with_the_fix(
    yesterday: tuple[Path, Path], name: str, change: Any, says: list[str]
) -> None:
    old, state = yesterday
    path = _variant(state, name, change(state))
    before = _pushgw("check-config", "--config", str(path), pythonpath=old)
    assert before.returncode == 0, before.stderr  # yesterday took it
    today = _pushgw("check-config", "--config", str(path))
    assert today.returncode == 2, today.stdout
    lines = today.stderr.splitlines()
    assert len(lines) == 1, today.stderr
    assert lines[0].startswith(f"pushgw: config error: {path}: ")
    for words in says:
        assert words in lines[0]
    assert "KEY0000001" not in lines[0] and "PRIVATE" not in lines[0]


# --- docs/sizing.md: the SQLite pragmas and what they cost --------------------------------


def _section(doc: str, heading: str) -> str:
    text_ = (ROOT / "docs" / doc).read_text()
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text_, re.M | re.S)
    assert match is not None, f"docs/{doc} has no section {heading!r}"
    return match.group(1)


async def test_sizing_doc_names_the_sqlite_pragmas_and_their_write_cost(tmp_path: Path) -> None:
    store = Store(f"sqlite+aiosqlite:///{tmp_path}/p.db")
    try:
        async with store.engine.connect() as conn:
            values = {
                name: (await conn.execute(text(f"PRAGMA {name}"))).scalar()
                for name in (
                    "journal_mode",
                    "synchronous",
                    "busy_timeout",
                    "secure_delete",
                    "journal_size_limit",
                )
            }
    finally:
        await store.close()
    spelled = {
        "journal_mode": str(values["journal_mode"]).upper(),
        "synchronous": {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[values["synchronous"]],
        "busy_timeout": str(values["busy_timeout"]),
        "secure_delete": "ON" if values["secure_delete"] else "OFF",
        "journal_size_limit": str(values["journal_size_limit"]),
    }
    section = _section("sizing.md", "SQLite write rate")
    for name, value in spelled.items():
        assert f"`{name}={value}`" in section, (name, value)
    # The cost an operator sizing SQLite needs, and that no migration is involved.
    assert re.search(r"write transactions a second fell by about \d+ %", section)
    assert "needs no migration" in section


# --- docs/privacy.md: rows freed before the upgrade ---------------------------------------


async def test_rows_deleted_before_the_upgrade_stay_until_the_documented_vacuum(
    tmp_path: Path,
) -> None:
    db = tmp_path / "pushgw.db"
    token = "a1b2c3d4" * 8  # an APNs token in clear, as Zulip registrations hold them
    # Yesterday's gateway on a SQLite whose default leaves deleted bytes in place.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA secure_delete=OFF")
        conn.execute("CREATE TABLE devices (id INTEGER PRIMARY KEY, token TEXT)")
        conn.executemany("INSERT INTO devices (token) VALUES (?)", [(token,), *[("f" * 64,)] * 20])
        conn.commit()
        conn.execute("DELETE FROM devices WHERE token = ?", (token,))
        conn.commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert token.encode() in db.read_bytes()

    # Today's gateway opens it and checkpoints, as the hourly sweep and forget do: the
    # bytes freed before stay (secure_delete zeroes what is deleted from then on).
    store = Store(f"sqlite+aiosqlite:///{db}")
    try:
        assert await store.checkpoint(truncate=True)
    finally:
        await store.close()
    assert token.encode() in db.read_bytes()

    section = _section("privacy.md", "Deleted means gone from the disk too")
    assert "After upgrading from a release before `secure_delete`" in section
    command = re.search(r'sqlite3 (\S+) "(VACUUM)"', section)
    assert command is not None
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute(command.group(2))
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("pushgw.db")]
    assert all(token.encode() not in p.read_bytes() for p in leftovers)


# --- docs/delivery.md: the latency histograms' new shape ----------------------------------

# f3e3be5's buckets of both latency histograms.
YESTERDAYS_BUCKETS = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}


def test_latency_upgrade_note_matches_the_exported_histogram() -> None:
    metrics = Metrics()
    metrics.push_latency.labels("matrix", "apns", "im.example.ios").observe(0.2)
    exported = text_string_to_metric_families(metrics.exposition().decode())
    family = next(f for f in exported if f.name == "pushgw_push_latency_seconds")
    buckets = [s for s in family.samples if s.name.endswith("_bucket")]
    assert {k for k in buckets[0].labels if k != "le"} == {"plugin", "provider", "app"}
    bounds = {float(s.labels["le"]) for s in buckets if s.labels["le"] != "+Inf"}
    assert bounds >= YESTERDAYS_BUCKETS  # "no bucket went away"
    text_ = (ROOT / "docs" / "delivery.md").read_text()
    note = text_[text_.index("**Upgrading recording rules and dashboards") :]
    note = note[: note.index("\n\n", note.index("- The new series"))]
    for bound in sorted(bounds - YESTERDAYS_BUCKETS):
        assert f'`le="{bound:g}"`' in note, bound
    assert f"0.001 to {max(YESTERDAYS_BUCKETS):g}" in note
    assert f"now have {min(bounds):g} to {max(bounds):g}" in note
    assert "sum by (le, plugin, provider)" in note
