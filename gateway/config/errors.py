"""Configuration errors: `ConfigError`, and the messages that name a key path and its origin.

A problem is reported against the key path where it lies (`server.port: ...`), and
against the environment variable when one set that key (`PUSHGW__SERVER__PORT: ...`),
else the file. No message carries a secret.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError


class ConfigError(Exception):
    """A configuration mistake; `str()` is the message shown to the operator."""

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


def bad_hook_result(plugin: str, hook: str, result: object, expected: str) -> ConfigError:
    """A plugin hook's result that is not what the hook returns, as one line naming the
    plugin, the hook and the type of what it returned (a plugin bug, not a traceback).

    A coroutine (an `async def` implementation of a hook that may not be async) is
    closed: it will never be awaited, and would warn so when collected.
    """
    if inspect.iscoroutine(result):
        result.close()
    returned = result.__name__ if isinstance(result, type) else type(result).__name__
    return ConfigError([f"plugin '{plugin}': its {hook} hook returned {returned}, not {expected}"])


def _key_error(key: str, message: str) -> PydanticCustomError:
    """A validation error about `key` of the model being validated (not the model itself).

    `_format_errors` appends `key` to the error's location; elsewhere the message reads
    `key: message`.
    """
    return PydanticCustomError("config_key", "{key}: {message}", {"key": key, "message": message})


Problem = tuple[tuple[str, ...], str]
"""A key path and what is wrong there."""

MAX_DEPTH = 100
"""Levels of nesting a YAML document or JSON value may have: far more than any config
needs, far fewer than Python's recursion (the parsers) and pydantic's serializer
(`check-config`) stand."""

MAX_VALUES = 1_000_000
"""Values a YAML document may hold once its aliases are expanded (a few aliases of
aliases make billions)."""


def nested_too_deeply(kind: str) -> str:
    """The problem of a `kind` ("YAML document", "JSON value") nested too deeply, also
    when its parser hits Python's recursion limit (RecursionError)."""
    return f"the {kind} is nested too deeply (more than {MAX_DEPTH} levels)"


def nesting_problem(value: Any, kind: str) -> str | None:
    """What makes the parsed `value` (`kind`: "YAML document", "JSON value") unfit to be
    configuration, or None: nested more than MAX_DEPTH levels (an alias inside itself
    is nested without end), or more than MAX_VALUES values. Iterative, and bounded by
    MAX_VALUES, so that it cannot fail or hang on what it checks."""
    stack = [(value, 0)]
    count = 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            return f"the {kind} is too large (more than {MAX_VALUES} values, aliases expanded)"
        if isinstance(item, Mapping):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= MAX_DEPTH:
            return nested_too_deeply(kind)
        stack.extend((child, depth + 1) for child in children)
    return None


def _format_errors(error: ValidationError, prefix: tuple[str, ...] = ()) -> list[Problem]:
    problems = []
    for item in error.errors():
        raw = [str(p) for p in (*prefix, *item["loc"])]
        # pydantic puts the app's union tag ("apns", "fcm") after `apps.<id>`: not a key.
        loc = [
            p
            for i, p in enumerate(raw)
            if not (i >= 2 and raw[i - 2] == "apps" and p in ("apns", "fcm"))
        ]
        msg = item["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if item["type"] == "extra_forbidden":
            msg = "unknown key"
        elif item["type"] == "config_key":
            ctx = item.get("ctx") or {}
            loc.append(str(ctx["key"]))
            msg = str(ctx["message"])
        problems.append((tuple(loc), msg))
    return problems


def _env_origin(
    origins: Mapping[tuple[str, ...], str], loc: Sequence[str]
) -> tuple[int, str] | None:
    """(length of the key path it set, name) of the variable that set `loc`, if one did."""
    path = tuple(loc)
    for length in range(len(path), 0, -1):
        name = origins.get(path[:length])
        if name is not None:
            return length, name
    return None


def _key_path(loc: Sequence[str]) -> str:
    """`server.port`; a key that is not printable (a newline in a YAML key) quoted, so
    that each problem stays one line."""
    return ".".join(p if p.isprintable() else repr(p) for p in loc)


def config_error(
    problems: Iterable[Problem],
    source: str | None,
    origins: Mapping[tuple[str, ...], str] | None = None,
    *,
    below: bool = False,
) -> ConfigError:
    """A ConfigError whose lines name the key path, and the environment variable when
    one set the key (`PUSHGW__SERVER__PORT: ...`), else the file (`source`).

    `origins`: `Settings.env_origins`. `below`: a problem with a whole section is the
    environment's too when a variable set a key inside it (`PUSHGW__PLUGINS__X__Y` for
    `plugins.x`), and the file's only if none did.
    """
    origins = origins or {}
    lines: list[tuple[str | None, str]] = []
    for loc, msg in problems:
        origin = _env_origin(origins, loc)
        inside = [n for p, n in sorted(origins.items()) if p[: len(loc)] == loc] if below else []
        if origin is None and loc and inside:
            lines.append((inside[0], f"{_key_path(loc)}: {msg}"))
        elif origin is None:
            lines.append((None, f"{_key_path(loc) or '<root>'}: {msg}"))
        else:
            length, name = origin
            rest = _key_path(loc[length:])
            lines.append((name, f"{rest}: {msg}" if rest else msg))
    if all(name is None for name, _ in lines):
        return ConfigError([text for _, text in lines], source)
    prefix = f"{source}: " if source else ""
    return ConfigError(f"{name}: {text}" if name else prefix + text for name, text in lines)
