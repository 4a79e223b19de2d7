"""Loading: the YAML file, merged with the environment, validated into `Settings`;
and each plugin's section validated against the plugin's model with the same rules.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gateway.config.env import _env_value, _merge, _target, environment_overrides
from gateway.config.errors import (
    ConfigError,
    Problem,
    _format_errors,
    bad_hook_result,
    config_error,
    nested_too_deeply,
    nesting_problem,
)
from gateway.config.proxy import environment_proxy, proxy_problem
from gateway.config.sections import Settings

CONFIG_ENV = "PUSHGW_CONFIG"


def yaml_document(data: bytes) -> Any:
    """The YAML document in a file's bytes (None when empty); `ValueError` saying what
    is wrong in words an operator can act on: not UTF-8 (with the byte), invalid YAML
    (with the line), or nested too deeply or too large (`nesting_problem`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not a YAML file: not UTF-8 text (byte {exc.start})") from None
    try:
        document = yaml.safe_load(text)
    except RecursionError:  # PyYAML builds nested collections recursively
        raise ValueError(nested_too_deeply("YAML document")) from None
    except yaml.reader.ReaderError as exc:  # a control character: its str() spans lines
        line = text.count("\n", 0, exc.position) + 1
        raise ValueError(
            f"line {line}: invalid YAML (character #x{exc.character:04x}: {exc.reason})"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ValueError(f"{where}invalid YAML ({getattr(exc, 'problem', exc)})") from None
    problem = nesting_problem(document, "YAML document")
    if problem:
        raise ValueError(problem)
    _join_surrogates(document)
    return document


_SURROGATE = re.compile("[\ud800-\udfff]")


def _joined(text: str, path: list[str]) -> str:
    """`text` with its UTF-16 surrogate pairs as the characters they stand for;
    `ValueError` naming the key path for a lone surrogate.

    PyYAML reads `"\\ud83d\\udd14"` (how JSON tools and JavaScript escape 🔔) as two
    lone surrogates, where JSON, which YAML 1.2 reads, means one character. A lone
    surrogate has no UTF-8 form: every push or answer carrying it would fail.
    """
    if text.isascii() or not _SURROGATE.search(text):
        return text
    try:
        return text.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        # A key may be the culprit: escaped, so that the message can be printed and stays
        # one line (the key may also hold a newline or another control character).
        where = ".".join(path)
        if not where.isprintable():
            where = where.encode("unicode_escape").decode("ascii")
        where = where or "the document"
        raise ValueError(
            f"{where}: a lone UTF-16 surrogate escape (\\udXXX) is no character; "
            "write the character itself or its \\UXXXXXXXX escape"
        ) from None


def _join_surrogates(document: Any) -> None:
    """Apply `_joined` to every string of `document`, keys included, in place (the
    document is fresh from the parser). Iterative: its nesting is bounded, not small."""
    stack: list[tuple[Any, list[str]]] = [(document, [])]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            items = [
                (_joined(k, [*path, k]) if isinstance(k, str) else k, v) for k, v in node.items()
            ]
            node.clear()
            node.update(items)
            for key, value in items:
                if isinstance(value, str):
                    node[key] = _joined(value, [*path, str(key)])
                else:
                    stack.append((value, [*path, str(key)]))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, str):
                    node[i] = _joined(value, [*path, str(i)])
                else:
                    stack.append((value, [*path, str(i)]))


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(["config file not found"], str(path)) from None
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror}"], str(path)) from None
    try:
        loaded = yaml_document(data) or {}
    except ValueError as exc:
        raise ConfigError([str(exc)], str(path)) from None
    if not isinstance(loaded, dict):
        raise ConfigError(["the top level must be a mapping"], str(path))
    return loaded


def config_path(explicit: str | os.PathLike[str] | None) -> Path | None:
    chosen = explicit or os.environ.get(CONFIG_ENV)
    return Path(chosen) if chosen else None


def load_settings(
    path: str | os.PathLike[str] | None = None, data: dict[str, Any] | None = None
) -> Settings:
    """Load and validate the core sections from `path` (or `$PUSHGW_CONFIG`) or `data`,
    with the environment's `PUSHGW__...` overrides."""
    file = config_path(path)
    raw = data if data is not None else (read_yaml(file) if file else {})
    source = str(file) if data is None and file else None
    env = environment_overrides()
    merged = _merge(raw, env.data)
    # Relative paths inside the file are relative to the working directory, as in Sygnal.
    # A top-level key YAML reads as a number (`1: x`) cannot be a keyword: reported as
    # pydantic reports one further down (`server.1: Keys should be strings`).
    problems: list[Problem] = [
        ((str(key),), "Keys should be strings") for key in merged if not isinstance(key, str)
    ]
    try:
        settings = Settings(**{k: v for k, v in merged.items() if isinstance(k, str)})
    except ValidationError as exc:
        problems += _format_errors(exc)
    if problems:
        raise config_error(problems, source, env.origins)
    if not settings.delivery.proxy and (found := environment_proxy()):
        # The proxy of the provider clients when delivery.proxy is not set
        # (`resolve_proxy`): checked here as delivery.proxy is, under its own name.
        name, value = found
        if problem := proxy_problem(value):
            raise ConfigError([f"{name}: {problem}"])
    settings._env_origins = env.origins
    return settings


def validate_plugin_section(
    settings: Settings, name: str, model: type[BaseModel], source: str | None = None
) -> BaseModel:
    """Validate `plugins.<name>` against the plugin's model, errors with full key paths."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        # A plugin's mistake, reported by its name in one line, not as an AttributeError.
        raise bad_hook_result(
            name, "pushgw_config_model", model, "a pydantic model class (or None)"
        )
    section = _plugin_env_values(settings, name, model, settings.plugins.section(name))
    try:
        return model.model_validate(section)
    except ValidationError as exc:
        raise config_error(
            _format_errors(exc, ("plugins", name)), source, settings.env_origins
        ) from None


def _plugin_env_values(
    settings: Settings, name: str, model: type[BaseModel], section: dict[str, Any]
) -> dict[str, Any]:
    """`section` with the text of its environment variables converted for `model`."""
    base = ("plugins", name)
    pending = {
        path[2:]: var
        for path, var in settings.env_origins.items()
        if len(path) > 2 and path[:2] == base
    }
    if not pending:
        return section
    section = copy.deepcopy(section)
    problems = []
    for path, var in sorted(pending.items()):
        holder: Any = section
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or not isinstance(holder.get(path[-1]), str):
            continue
        try:
            holder[path[-1]] = _env_value(_target(model, path, base), holder[path[-1]], var)
        except ValueError as exc:
            problems.append(f"{var}: {exc}")
    if problems:
        raise ConfigError(problems)
    return section
