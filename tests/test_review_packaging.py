"""Review: pushgw as an operator installs it, from a wheel, not from the source tree.

`make test` installs the project editable, so a file the code opens at run time but the
wheel leaves out, or a path that only works where the source tree lives, is invisible to
the rest of the suite. These tests build the real wheel (with the installed build
backend, no network) and run the migrations from where an installed copy may live.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from configparser import ConfigParser
from pathlib import Path

import pytest

import spark_plugins.submit
from gateway.core import store
from plugins.zulip import plugin as zulip_plugin
from spark_plugins.builtin import BUILTIN_JOBS

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
SKIP = ("__pycache__", ".mypy_cache", ".pytest_cache")


def _source_files(directory: Path) -> set[str]:
    """Every file under `directory` a wheel must carry, relative to the repository."""
    return {
        p.relative_to(REPO).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and not any(part in SKIP for part in p.parts) and p.suffix != ".pyc"
    }


def _migration_dirs() -> list[Path]:
    """The directories the code hands Alembic: the core's, and every built-in plugin's
    `pushgw_migrations` hook (the same call `pushgw db upgrade` makes)."""
    import importlib

    dirs = [store.MIGRATIONS_DIR]
    for target in PYPROJECT["project"]["entry-points"]["pushgw.plugins"].values():
        module = importlib.import_module(target)
        hook = getattr(module, "pushgw_migrations", None)
        if hook is not None:
            dirs.append(Path(hook()))
    return dirs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    pytest.importorskip("hatchling", reason="the build backend (the dev extra installs it)")
    out = tmp_path_factory.mktemp("wheel")
    before = {p.name for p in REPO.iterdir()}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("--no-index", "--quiet", "-w", str(out), str(REPO)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    left = {p.name for p in REPO.iterdir()} - before
    assert not left, f"the build left {left} in the source tree"
    (found,) = out.glob("pushgw-*.whl")
    with zipfile.ZipFile(found) as zf:
        yield zf


def test_wheel_carries_every_file_of_the_packages(wheel: zipfile.ZipFile) -> None:
    """Migrations (env.py, script.py.mako, versions/), the spark-submit scripts, and any
    data file added later: whatever lies in a package directory is in the wheel."""
    names = set(wheel.namelist())
    expected: set[str] = set()
    for package in PACKAGES:
        expected |= _source_files(REPO / package)
    assert expected, "no package files found"
    missing = sorted(expected - names)
    assert not missing, f"missing from the wheel: {missing}"


def test_wheel_carries_what_the_code_opens_at_run_time(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    opened: set[str] = set()
    for directory in _migration_dirs():
        files = _source_files(directory)
        assert any(f.endswith(".py") and "__init__" not in f for f in files), directory
        opened |= files
    assert "gateway/core/migrations/env.py" in opened
    assert "gateway/core/migrations/script.py.mako" in opened
    submit = Path(spark_plugins.submit.DIR)
    opened |= _source_files(submit)
    for job in BUILTIN_JOBS:
        if job.submit_script:
            opened.add((submit / job.submit_script).relative_to(REPO).as_posix())
    missing = sorted(opened - names)
    assert not missing, f"opened at run time but missing from the wheel: {missing}"


def test_wheel_entry_points_match_pyproject_and_resolve(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    (entry_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    parser = ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(wheel.read(entry_file).decode())
    project = PYPROJECT["project"]
    assert dict(parser["console_scripts"]) == project["scripts"]
    assert dict(parser["pushgw.plugins"]) == project["entry-points"]["pushgw.plugins"]
    targets = [v.split(":")[0] for v in [*project["scripts"].values()]]
    targets += list(project["entry-points"]["pushgw.plugins"].values())
    for module in targets:
        path = module.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, module


@pytest.mark.parametrize("where", ["with space", "100%", "a,b"])
def test_migrations_run_from_an_install_path_with_a_space_or_percent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An installed copy under `/opt/Push Gateway/venv/...` (or a `%` in the path): the
    core's and a plugin's migrations all apply, and `db upgrade` does not say "at head"
    over an empty database."""
    site = tmp_path / where / "site-packages"
    ignore = shutil.ignore_patterns("__pycache__")
    core = shutil.copytree(store.MIGRATIONS_DIR, site / "gateway/core/migrations", ignore=ignore)
    zulip = shutil.copytree(
        zulip_plugin.pushgw_migrations(), site / "plugins/zulip/migrations", ignore=ignore
    )
    monkeypatch.setattr(store, "MIGRATIONS_DIR", Path(core))
    db = tmp_path / "pushgw.db"
    store.upgrade(f"sqlite+aiosqlite:///{db}", [str(zulip)])
    with sqlite3.connect(db) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert {"pushgw_invalid_tokens", "zulip_servers", "zulip_realms"} <= tables
