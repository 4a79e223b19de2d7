"""Environment overrides: the `PUSHGW__SECTION__KEY` variables, read against the models.

`environment_overrides` checks every variable against the core model (or leaves it
for a plugin's model, inside `plugins.<name>`) and converts its text to the key's
type; `_merge` lays the result over the file.

Written here rather than left to pydantic-settings' environment source (which
`Settings` turns off), because that source cannot do what operators are promised: it
ignores a misspelled variable, reports a bad value under the key path with neither the
variable nor the file it overrides named, takes lists only as JSON, and cannot see the
plugin sections, whose models are known only once the plugins are loaded.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

from gateway.config.base import ConfigModel
from gateway.config.errors import ConfigError, nested_too_deeply, nesting_problem
from gateway.config.sections import Origins, Settings

ENV_PREFIX = "PUSHGW__"


@dataclass(frozen=True)
class EnvOverrides:
    """The `PUSHGW__...` variables as a nested mapping, and which variable set which key."""

    data: dict[str, Any]
    origins: Origins


_NONE = type(None)
_FREE: Any = object()  # a key only a plugin's model knows (inside `plugins.<name>`)


def _members(annotation: Any) -> list[Any]:
    """The types a value of `annotation` may have (Annotated, Optional and unions opened)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for a in get_args(annotation) if a is not _NONE for m in _members(a)]
    return [annotation]


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _is_mapping(t: Any) -> bool:
    origin = get_origin(t) or t
    return isinstance(origin, type) and issubclass(origin, Mapping)


def _is_list(t: Any) -> bool:
    origin = get_origin(t) or t
    return (
        isinstance(origin, type)
        and issubclass(origin, (Sequence, set, frozenset))
        and not issubclass(origin, (str, bytes))
    )


def _field(model: type[BaseModel], key: str) -> Any:
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return info.annotation
    secret = key[: -len("_file")] if key.endswith("_file") else None
    if secret and issubclass(model, ConfigModel) and _field(model, secret) is not None:
        return str  # a secret from a file (`ConfigModel._secrets_from_files`)
    if model.model_config.get("extra") == "allow":
        return _FREE
    return None


def _target(root: Any, path: tuple[str, ...], base: tuple[str, ...] = ()) -> list[Any] | None:
    """The types the key `path` below `root` may have; None when no model knows it here
    (free-form: a plugin's section, or a plugin model that allows extra keys).

    Raises ValueError for a key no model has, or for keys below a plain value.
    """
    candidates = _members(root)
    for i, key in enumerate(path):
        found: list[Any] = []
        for t in candidates:
            if _is_model(t):
                field = _field(t, key)
                if field is _FREE:
                    return None
                if field is not None:
                    found += _members(field)
            elif _is_mapping(t):
                args = get_args(t)
                found += _members(args[1]) if len(args) == 2 else [Any]
            elif t is Any:
                return None
        if not found:
            if any(_is_model(t) or _is_mapping(t) for t in candidates):
                raise ValueError(f"unknown key '{'.'.join((*base, *path[: i + 1]))}'")
            raise ValueError(f"'{'.'.join((*base, *path[:i]))}' takes a value, not keys")
        candidates = found
    return candidates


def _env_value(candidates: list[Any] | None, raw: str, name: str) -> Any:
    """The text of the environment variable `name` as the value of a key of one of the
    types `candidates` (None: unknown).

    Lists: a JSON array, or comma-separated items. Mappings and sections: a JSON object.
    Anything else: the text, which the model converts (`8080`, `true`, `2.5`, ...).
    Where the type is unknown, text that starts with `[` or `{` is read as JSON.
    """
    text = raw.strip()
    if candidates is None:
        as_list, as_object = text.startswith("["), text.startswith("{")
    else:
        as_list = any(_is_list(t) for t in candidates)
        as_object = any(_is_model(t) or _is_mapping(t) for t in candidates)
    if not (as_list or as_object):
        return raw
    if as_list and not text.startswith("["):
        return [item.strip() for item in raw.split(",") if item.strip()]
    if as_object and not as_list and not text.startswith("{"):
        raise ValueError(f"expected a JSON object, or one variable per key ({name}__<KEY>)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise ValueError(nested_too_deeply("JSON value")) from None
    problem = nesting_problem(value, "JSON value")
    if problem:
        raise ValueError(problem)
    if as_list and not isinstance(value, list) and not (as_object and isinstance(value, dict)):
        raise ValueError("expected a JSON array or comma-separated items")
    if as_object and not isinstance(value, dict) and not (as_list and isinstance(value, list)):
        raise ValueError("expected a JSON object")
    return value


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def environment_overrides(environ: Mapping[str, str] | None = None) -> EnvOverrides:
    """The `PUSHGW__SECTION__KEY` variables of `environ` (default: `os.environ`).

    Names are matched case-insensitively and the keys are lower case. Every variable
    must name a key of the core model or lie inside a plugin section (checked against
    the plugin's model by `validate_plugin_section`); a misspelled one is an error,
    as an unknown key in the file is. Raises ConfigError naming each variable.
    """
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    found: list[tuple[tuple[str, ...], str]] = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = tuple(name[len(ENV_PREFIX) :].lower().split("__"))
        if not all(path):
            problems.append(f"{name}: not a config key (PUSHGW__SECTION__KEY, joined by __)")
        else:
            found.append((path, name))
    for i, (path, name) in enumerate(found):
        for other, other_name in found[i + 1 :]:
            shorter, longer = sorted((path, other), key=len)
            if longer[: len(shorter)] == shorter:
                problems.append(f"{name}: conflicts with {other_name} (set one of them)")
    data: dict[str, Any] = {}
    origins: Origins = {}
    for path, name in found:
        try:
            candidates = _target(Settings, path)
            if path[0] == "plugins" and len(path) == 2 and path[1] != "enabled":
                candidates = [dict]  # a whole plugin section
            elif candidates is None:
                candidates = [str]  # converted for the plugin's model by validate_plugin_section
            value = _env_value(candidates, environ[name], name)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        _put(data, path, value)
        origins[path] = name
    if problems:
        raise ConfigError(problems)
    return EnvOverrides(data, origins)


def _merge(base: Any, override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` (from the environment) deep-merged over `base` (from the file).

    A variable for `X_file` replaces the file's `X` and one for `X` its `X_file`: the
    environment wins, and the pair set together would be an error.
    """
    out = dict(base) if isinstance(base, Mapping) else {}
    for key, value in override.items():
        sibling = key[: -len("_file")] if key.endswith("_file") else f"{key}_file"
        if sibling not in override:
            out.pop(sibling, None)
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
