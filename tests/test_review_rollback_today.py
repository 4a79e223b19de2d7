"""Rolling back from today's pushgw to this morning's commit (f3e3be5), from an operator's
seat: docs/cli.md, "Rolling back a release".

Today's code makes the state (a configuration with its new keys, a SQLite database it
migrated and erased rows from, a `pushgw db backup` copy, receipts with its new reasons);
then f3e3be5's own code, taken with `git archive` into a scratch directory and run with
only that tree on `PYTHONPATH`, is run on it. What each side knows (config keys, metric
families, receipt reasons) is read from the code of each, so that the procedure's lists
are checked against the code rather than against a copy. Where the checkout does not
hold f3e3be5 (a shallow clone, an sdist) the tests are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MORNING = "f3e3be5"

# What a tree knows, printed as JSON by that tree's own code (run in a subprocess).
KNOWS = textwrap.dedent(
    """
    import importlib, json, types
    from typing import Annotated, Any, Union, get_args, get_origin

    from prometheus_client.parser import text_string_to_metric_families
    from pydantic import BaseModel

    from gateway.config.sections import PluginsSection, Settings
    from gateway.core.metrics import Metrics
    from gateway.core.push import Reason


    def members(a: Any) -> list[Any]:
        while get_origin(a) is Annotated:
            a = get_args(a)[0]
        if get_origin(a) in (Union, types.UnionType) or get_origin(a) is not None:
            return [m for x in get_args(a) if x is not type(None) for m in members(x)]
        return [a]


    def walk(model: type[BaseModel], prefix: str) -> set[str]:
        keys = set()
        for name, info in model.model_fields.items():
            key = prefix + (info.alias or name)
            keys.add(key)
            for m in members(info.annotation):
                if isinstance(m, type) and issubclass(m, BaseModel) and m is not PluginsSection:
                    keys |= walk(m, key + ".")
        return keys


    keys = walk(Settings, "")
    for plugin in ("matrix", "zulip", "marmot"):
        module = importlib.import_module(f"plugins.{plugin}.plugin")
        keys |= walk(module.pushgw_config_model(), f"plugins.{plugin}.")
    metrics = Metrics()
    families = [f.name for f in text_string_to_metric_families(metrics.exposition().decode())]
    print(json.dumps({
        "keys": sorted(keys),
        "families": sorted(families),
        "latency_labels": list(metrics.push_latency._labelnames),
        "reasons": sorted(v for k, v in vars(Reason).items() if k.isupper()),
    }))
    """
)

WRITE_RECEIPTS = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path

    from gateway.core.push import Outcome, ProviderKind, Receipt, Reason
    from gateway.core.receipts import ReceiptWriter


    async def main(directory: Path, file_format: str) -> None:
        writer = ReceiptWriter(directory, file_format=file_format)
        await writer.start()
        now = time.time()
        reasons = [Reason.CERTIFICATE_EXPIRED, Reason.CERTIFICATE_REFUSED, None]
        for i, reason in enumerate(reasons):
            await writer.put(Receipt(
                push_id=f"p{i}", plugin="matrix", app_id="com.example.ios",
                provider=ProviderKind.APNS,
                outcome=Outcome.PERMANENT if reason else Outcome.OK,
                status=None if reason else 200, reason=reason,
                attempts=0 if reason == Reason.CERTIFICATE_EXPIRED else 1,
                latency=0.01, finished_at=now - 10 + i, token_hash=f"{i:064x}",
            ))
        await writer.close()


    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
    """
)


def _env(pythonpath: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    env["PYTHONPATH"] = str(pythonpath)
    return env


def _python(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(tree),
        cwd=tree,
    )


def _pushgw(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _python(tree, "-m", "gateway.cli", *args)


@pytest.fixture(scope="module")
def morning(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """f3e3be5's source tree."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("no git to take f3e3be5's tree from")
    found = subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "-e", f"{MORNING}^{{commit}}"], capture_output=True
    )
    if found.returncode != 0:
        pytest.skip(f"the checkout does not hold {MORNING} (a shallow clone?)")
    base = tmp_path_factory.mktemp("rollback_today")
    archive, old = base / "old.tar", base / "old"
    with archive.open("wb") as out:
        subprocess.run([git, "-C", str(ROOT), "archive", MORNING], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(old, filter="data")
    return old


@pytest.fixture(scope="module")
def knows(morning: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """{"today": ..., "morning": ...}: what each tree's code knows (KNOWS)."""
    script = tmp_path_factory.mktemp("knows") / "knows.py"
    script.write_text(KNOWS)
    result = {}
    for name, tree in (("today", ROOT), ("morning", morning)):
        done = _python(tree, str(script))
        assert done.returncode == 0, done.stderr
        result[name] = json.loads(done.stdout)
    return result


def _rollback_section() -> str:
    text = (ROOT / "docs" / "cli.md").read_text()
    match = re.search(r"^### Rolling back a release\n(.*?)(?=^##)", text, re.M | re.S)
    assert match is not None, "docs/cli.md has no 'Rolling back a release'"
    return match.group(1)


def _added(knows: dict[str, dict[str, Any]], what: str) -> list[str]:
    return sorted(set(knows["today"][what]) - set(knows["morning"][what]))


# --- configuration ------------------------------------------------------------------------


def _config_with_todays_keys(state: Path) -> dict[str, Any]:
    from gateway.testing.apns_sim import generate_apns_auth_key
    from gateway.testing.certs import SimulatorCA

    generate_apns_auth_key("KEY0000001", "TEAM000001").write_p8(state / "key.p8")
    (state / "marmot.key").write_text("11" * 32 + "\n")
    (state / "marmot.key").chmod(0o600)
    ca = SimulatorCA(state / "ca")
    apns = {
        "type": "apns",
        "keyfile": str(state / "key.p8"),
        "key_id": "KEY0000001",
        "team_id": "TEAM000001",
        "topic": "com.example.ios",
    }
    return {
        "server": {"shutdown_delay": 5.0},
        "delivery": {"invalidation_guard_start": 3},
        "store": {"url": f"sqlite+aiosqlite:///{state}/pushgw.db"},
        "receipts": {"directory": str(state / "receipts"), "hmac_key": "today-key-" * 3},
        "plugins": {
            "enabled": ["matrix", "marmot"],
            "matrix": {"apps": {"com.example.ios": dict(apns)}},
            "marmot": {
                "server_secret_key_file": str(state / "marmot.key"),
                "inbox_relays": ["wss://relay.example.org"],
                "ca_file": str(ca.ca_path),
                "apps": {"com.example.ios": dict(apns)},
                "apns": {"app": "com.example.ios"},
            },
        },
    }


def _remove(config: dict[str, Any], dotted: str) -> bool:
    *parents, last = dotted.split(".")
    node: Any = config
    for part in parents:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, dict) and node.pop(last, None) is not None


def test_the_rollback_procedure_names_every_key_the_older_release_refuses(
    morning: Path, knows: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    added = _added(knows, "keys")
    assert added, "today added no config key: this test has nothing left to check"
    section = _rollback_section()
    listed = re.findall(r"^\s*\| `([a-z_.]+)` \|", section, re.M)
    assert sorted(listed) == added

    config = _config_with_todays_keys(tmp_path)
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(config))
    assert _pushgw(ROOT, "check-config", "--config", str(path)).returncode == 0
    # One line per key, a plugin's once the core's sections are right (as the procedure
    # says): each is refused until it is taken out.
    assert "unknown key" in section and "status 2" in section
    assert "a plugin's once the core's are right" in section
    refused_keys = []
    for _ in added:
        refused = _pushgw(morning, "check-config", "--config", str(path))
        assert refused.returncode == 2, refused.stdout
        named = re.findall(r": ([a-z_.]+): unknown key$", refused.stderr, re.M)
        assert named and set(named) <= set(listed), refused.stderr
        refused_keys += named
        for key in named:
            assert _remove(config, key)
        path.write_text(yaml.safe_dump(config))
        if len(refused_keys) == len(added):
            break
    assert sorted(refused_keys) == added

    # As an environment variable too.
    env = _env(morning) | {"PUSHGW__SERVER__SHUTDOWN_DELAY": "5"}
    by_env = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=morning,
    )
    assert by_env.returncode == 2 and "shutdown_delay" in by_env.stderr
    assert "`PUSHGW__...` environment" in section

    # With the listed keys taken out, the older release takes the configuration.
    taken = _pushgw(morning, "check-config", "--config", str(path))
    assert taken.returncode == 0, taken.stderr


# --- database -----------------------------------------------------------------------------


def _revisions(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return sorted(row[0] for row in conn.execute("SELECT version_num FROM alembic_version"))


def _heads(tree: Path) -> list[str]:
    heads = []
    for directory in (
        tree / "gateway" / "core" / "migrations",
        tree / "plugins" / "zulip" / "migrations",
    ):
        names = sorted(p.stem for p in directory.rglob("*_0*.py"))
        heads.append(re.sub(r"^(\w+?_\d{4}).*$", r"\1", names[-1]))
    return sorted(heads)


def test_the_older_release_runs_on_the_database_today_erased_rows_from(
    morning: Path, tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import sizing
    finally:
        sys.path.remove(str(ROOT / "bench"))

    db = tmp_path / "pushgw.db"
    url = f"sqlite+aiosqlite:///{db}"
    asyncio.run(sizing.database_bytes(url, 5))  # today's code migrates and fills it
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": {"url": url},
                "receipts": {"directory": str(tmp_path / "r"), "hmac_key": "today-key-" * 3},
                "plugins": {"enabled": ["zulip"]},
            }
        )
    )
    with contextlib.closing(sqlite3.connect(db)) as conn:
        before = conn.execute("SELECT count(*) FROM zulip_e2ee_devices").fetchone()[0]
        token_hash = conn.execute("SELECT token_hash FROM zulip_e2ee_devices").fetchone()[0]
    forgot = _pushgw(ROOT, "--config", str(config), "zulip", "forget", "--token-hash", token_hash)
    assert forgot.returncode == 0, forgot.stderr
    copy = tmp_path / "backup.db"
    backed = _pushgw(ROOT, "--config", str(config), "db", "backup", str(copy))
    assert backed.returncode == 0, backed.stderr

    # The pragmas are the connection's, not the file's: a connection that does not set
    # them (the older release's) gets SQLite's defaults.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA journal_size_limit").fetchone()[0] == -1

    # No revision today: nothing to downgrade, as the procedure says.
    revisions = _revisions(db)
    assert revisions == _heads(morning) == _heads(ROOT)
    section = _rollback_section()
    assert all(f"`{r}`" in section for r in revisions)
    assert "nothing to downgrade" in section

    for database in (db, copy):
        if database == copy:
            url_copy = f"sqlite+aiosqlite:///{copy}"
            config.write_text(config.read_text().replace(url, url_copy))
        upgraded = _pushgw(morning, "--config", str(config), "db", "upgrade")
        assert upgraded.returncode == 0, upgraded.stderr
        assert _revisions(database) == revisions
        listed = _pushgw(morning, "--config", str(config), "zulip", "servers")
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.strip()
        with contextlib.closing(sqlite3.connect(database)) as conn:
            rows = conn.execute("SELECT count(*) FROM zulip_e2ee_devices").fetchone()[0]
            gone = conn.execute(
                "SELECT count(*) FROM zulip_e2ee_devices WHERE token_hash = ?", (token_hash,)
            ).fetchone()[0]
        assert (rows, gone) == (before - 1, 0)  # the erasure stays done

    for words in ("`secure_delete`", "`journal_size_limit`", "not stored in the database"):
        assert words in section
    privacy = (ROOT / "docs" / "privacy.md").read_text()
    assert "After rolling back to a release before `secure_delete`" in privacy


# --- receipts -----------------------------------------------------------------------------


def test_the_older_release_reads_the_receipts_with_todays_reasons(
    morning: Path, knows: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    added = _added(knows, "reasons")
    assert added, "today added no receipt reason: this test has nothing left to check"
    script = tmp_path / "write.py"
    script.write_text(WRITE_RECEIPTS)
    directories = []
    for file_format in ("jsonl", "parquet"):
        directory = tmp_path / file_format
        done = _python(ROOT, str(script), str(directory), file_format)
        assert done.returncode == 0, done.stderr
        directories.append(str(directory))
    today = _pushgw(ROOT, "receipts", "cat", *directories)
    old = _pushgw(morning, "receipts", "cat", *directories)
    assert old.returncode == 0, old.stderr
    assert old.stdout == today.stdout
    reasons = {json.loads(line)["reason"] for line in old.stdout.splitlines()}
    assert set(added) <= reasons
    section = _rollback_section()
    for reason in added:
        assert f"`{reason}`" in section


# --- metrics, alert rules, dashboards -----------------------------------------------------


def test_the_rollback_procedure_names_the_metrics_and_alerts_that_go_silent(
    knows: dict[str, dict[str, Any]],
) -> None:
    section = _rollback_section()
    added = [f for f in _added(knows, "families") if not f.endswith("_created")]
    assert added
    for family in added:
        assert f"`{family}`" in section or f"`{family}_total`" in section, family
    rules = yaml.safe_load((ROOT / "config" / "alerts.yml").read_text())["groups"][0]["rules"]
    silent = [
        rule["alert"]
        for rule in rules
        if any(re.search(rf"\b{f}(_total)?\b", rule["expr"]) for f in added)
    ]
    assert silent
    for alert in silent:
        assert f"`{alert}`" in section, alert
    assert "go silent" in section

    lost = set(knows["today"]["latency_labels"]) - set(knows["morning"]["latency_labels"])
    assert lost == {"app"}
    assert "`pushgw_push_latency_seconds` loses its `app` label" in section
