"""App-id routing: exact name first, then globs; ambiguity is a rejection (matrix.md §1.3)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

__all__ = ["AppRouter", "Route", "RouteError", "glob_to_regex"]


def glob_to_regex(glob: str) -> re.Pattern[str]:
    """`*` = any run of characters except newlines, `?` = one character, rest literal.

    Matches the whole string, case-sensitively (matrix-python-common semantics).
    """
    parts = []
    for char in glob:
        if char == "*":
            parts.append(".*?")
        elif char == "?":
            parts.append(".")
        else:
            parts.append(re.escape(char))
    return re.compile(r"\A" + "".join(parts) + r"\Z")


class RouteError(Enum):
    UNKNOWN = "unknown app ID"
    AMBIGUOUS = "ambiguous app ID"


@dataclass(frozen=True, slots=True)
class Route:
    app: str | None
    error: RouteError | None = None


class AppRouter:
    """Finds the configured app for a device's `app_id`; results are cached."""

    def __init__(self, names: Iterable[str], cache_size: int = 4096) -> None:
        self.names = frozenset(names)
        self._globs = [(name, glob_to_regex(name)) for name in sorted(self.names) if _is_glob(name)]
        self._cache: dict[str, Route] = {}
        self._cache_size = cache_size

    def route(self, app_id: str) -> Route:
        if app_id in self.names:
            return Route(app_id)
        cached = self._cache.get(app_id)
        if cached is not None:
            return cached
        matches = [name for name, pattern in self._globs if pattern.match(app_id)]
        if not matches:
            result = Route(None, RouteError.UNKNOWN)
        elif len(matches) > 1:
            result = Route(None, RouteError.AMBIGUOUS)
        else:
            result = Route(matches[0])
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[app_id] = result
        return result


def _is_glob(name: str) -> bool:
    return "*" in name or "?" in name
