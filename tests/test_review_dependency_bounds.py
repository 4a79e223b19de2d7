"""pyproject's declared bounds cover what the code uses.

A packager who installs pushgw with the lowest versions pyproject allows
(`uv pip install --resolution lowest-direct`) must get a gateway that imports and runs.
Each row of `LATE_APIS` names an API that appeared in a later release than a library's
first 1.0-style version: wherever the sources use it, pyproject's lower bound for that
library must be at least the release that brought it, or the lowest install fails with
an ImportError / AttributeError. The evidence for each release is in the row's comment.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from gateway.config import ConfigError
from gateway.config.loading import read_yaml

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PRODUCT = ("gateway", "plugins", "spark_plugins")

# (distribution, first version with the API, pattern of its use, where the use counts)
LATE_APIS: list[tuple[str, str, str, tuple[str, ...]]] = [
    # aiohttp 3.13.5 has no web.RequestKey (AttributeError at import of the Zulip plugin)
    ("aiohttp", "3.14", r"\bweb\.RequestKey\b", PRODUCT),
    # pydantic 2.10 and older: ImportError; pydantic.functional_validators has it from 2.0
    (
        "pydantic",
        "2.11",
        r"from pydantic import (\([^)]*|[^\n(]*)\bModelWrapValidatorHandler\b",
        PRODUCT,
    ),
    # pyspark 4.1.0's functions have kll_sketch_* but no kll_merge_agg_* (apache/spark#56135)
    ("pyspark", "4.1.2", r"\bkll_merge_agg_(double|float|bigint)\b", PRODUCT),
    # nostr-sdk 0.40 to 0.44: EventBuilder.build, no finalize_unsigned, no nip59_make_gift_wrap
    ("nostr-sdk", "0.45", r"\.finalize_unsigned\(|\bnip59_make_gift_wrap\b", ("tests",)),
]


def declared_lower_bounds() -> dict[str, Version]:
    """The highest lower bound pyproject gives each distribution, base or any extra."""
    lists = [PYPROJECT["project"]["dependencies"]]
    lists += PYPROJECT["project"].get("optional-dependencies", {}).values()
    bounds: dict[str, Version] = {}
    for line in (entry for entries in lists for entry in entries):
        req = Requirement(line)
        name = canonicalize_name(req.name)
        lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
        bounds[name] = max([bounds.get(name, Version("0")), *lows])
    return bounds


def uses(pattern: str, roots: tuple[str, ...]) -> list[str]:
    found = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            if re.search(pattern, path.read_text(encoding="utf-8")):
                found.append(str(path.relative_to(REPO)))
    return found


@pytest.mark.parametrize(
    ("dist", "since", "pattern", "roots"), LATE_APIS, ids=[row[0] for row in LATE_APIS]
)
def test_lower_bound_covers_late_api(
    dist: str, since: str, pattern: str, roots: tuple[str, ...]
) -> None:
    users = uses(pattern, roots)
    if not users:
        return  # not used (any more): the bound may be lower
    bound = declared_lower_bounds().get(canonicalize_name(dist))
    assert bound is not None, f"{dist} is used by {users} but not declared in pyproject"
    assert bound >= Version(since), (
        f"{users} use an API first in {dist} {since}; pyproject allows {dist} {bound}"
    )


def test_the_patterns_still_find_the_uses_they_guard() -> None:
    """The table is not stale: the APIs that forced a bound are still found where used."""
    for dist in ("aiohttp", "pyspark", "nostr-sdk"):
        _, _, pattern, roots = next(row for row in LATE_APIS if row[0] == dist)
        assert uses(pattern, roots), dist


def test_tools_target_the_oldest_python_declared() -> None:
    """ruff and mypy check the code against requires-python's floor, so syntax or stdlib
    newer than the floor is an error there, not on a user's older interpreter."""
    floor = re.fullmatch(r">=\s*3\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert floor, PYPROJECT["project"]["requires-python"]
    minor = floor.group(1)
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py3{minor}"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == f"3.{minor}"


def test_a_lone_surrogate_in_a_key_with_a_newline_is_a_one_line_error(tmp_path: Path) -> None:
    """Found by tests/test_review_fuzz.py on the lowest-versions install (hypothesis 6.100
    drew it; any version can): the key `"\\ud800\\n"` made a config error of two lines."""
    path = tmp_path / "config.yaml"
    path.write_text('server: {}\n"\\ud800\\n": null\n', encoding="ascii")
    with pytest.raises(ConfigError) as caught:
        read_yaml(path)
    (problem,) = caught.value.problems
    assert problem.isprintable(), problem  # one line, no control character
    assert problem.startswith("\\ud800\\n: a lone UTF-16 surrogate escape"), problem


def test_spark_without_kll_merge_falls_back_from_sketch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cluster's pyspark 4.1.0 or 4.1.1 (`spark-submit` uses the cluster's), the
    default `percentiles: sketch` must fall back to `approx`, not end the job with an
    AttributeError: those releases have `kll_sketch_agg_double` but no `kll_merge_agg_double`."""
    functions = pytest.importorskip("pyspark.sql.functions")
    from spark_plugins.delivery_report import has_sketches

    monkeypatch.setattr(functions, "kll_sketch_agg_double", lambda *a: None, raising=False)
    monkeypatch.delattr(functions, "kll_merge_agg_double", raising=False)
    assert not has_sketches()
