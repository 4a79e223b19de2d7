"""Plugin discovery and calling.

Every plugin, built-in or third-party, is found the same way: an entry point in the
`pushgw.plugins` group whose name is the plugin name and whose value is the module
(or object) holding the hook implementations. `plugins.enabled` in the config says
which ones run; `pushgw plugins` lists all installed ones.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from gateway import hookspecs
from gateway.config import ConfigError
from gateway.config.sections import ENABLED_NOT_A_STRING
from gateway.core.errors import kind_and_place

ENTRY_POINT_GROUP = "pushgw.plugins"

log = logging.getLogger(__name__)

LOAD_HOOKS = frozenset({"pushgw_config_model", "pushgw_apps", "pushgw_tables", "pushgw_migrations"})
"""Hooks called while the configuration is loaded (`load_gateway`, `pushgw db ...`): one
that raises is a configuration error naming the plugin (`PluginRegistry.call`)."""


@dataclass(frozen=True)
class PluginInfo:
    """An installed plugin as `pushgw plugins` shows it."""

    name: str
    target: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]
    enabled: bool
    error: str | None = None


def _entry_points() -> dict[str, metadata.EntryPoint]:
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)  # first on sys.path wins, like imports
    return found


def _dist_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def implemented_hooks(plugin: object) -> tuple[str, ...]:
    return tuple(
        sorted(n for n in dir(plugin) if n.startswith("pushgw_") and callable(getattr(plugin, n)))
    )


class PluginRegistry:
    """The enabled plugins, registered with a pluggy manager in `enabled` order.

    `extra` registers plugin objects directly under a name (tests and embedding);
    they behave exactly like entry-point plugins.
    """

    def __init__(self, enabled: Iterable[str], extra: dict[str, object] | None = None) -> None:
        if isinstance(enabled, str):  # else read character by character: "unknown plugin 'm'"
            raise ConfigError([f"plugins.enabled: {ENABLED_NOT_A_STRING}"])
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.names: list[str] = []
        self._callers: dict[tuple[str, str], Any] = {}
        extra = dict(extra or {})
        available = _entry_points()
        for name in enabled:
            if name in self.names:
                raise ConfigError([f"plugins.enabled: '{name}' is listed twice"])
            if name in extra:
                plugin = extra.pop(name)
            elif name in available:
                plugin = self._load(name, available[name])
            else:
                known = ", ".join(sorted(set(available) | set(extra))) or "none"
                raise ConfigError(
                    [f"plugins.enabled: unknown plugin '{name}' (installed: {known})"]
                )
            self._register(name, plugin)
        for name, plugin in extra.items():  # extras not listed in enabled still run
            self._register(name, plugin)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            # pluggy names the plugin object (a module's repr, with its path), twice
            name = self.pm.get_name(exc.plugin) or repr(exc.plugin)
            specs = {n for n in dir(hookspecs) if n.startswith("pushgw_")}
            unknown = [h for h in implemented_hooks(exc.plugin) if h not in specs]
            hooks = ", ".join(f"'{h}'" for h in unknown) or "?"
            raise ConfigError([f"plugin '{name}': unknown hook {hooks}"]) from None

    def _register(self, name: str, plugin: object) -> None:
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            # A hook whose arguments the spec lacks: pluggy's message spans three lines.
            detail = "; ".join(line.strip() for line in str(exc).splitlines()[1:] if line.strip())
            raise ConfigError([f"plugin '{name}': {detail}"]) from None
        self.names.append(name)

    @staticmethod
    def _load(name: str, ep: metadata.EntryPoint) -> object:
        try:
            return ep.load()
        except Exception as exc:  # a broken third-party plugin must not be a traceback
            raise ConfigError(
                [f"plugins.enabled: plugin '{name}' failed to load: {exc!r}"]
            ) from None

    def plugin(self, name: str) -> object:
        return self.pm.get_plugin(name)

    def call(self, name: str, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of a per-plugin hook; None if it has none.

        A hook of `LOAD_HOOKS` that raises is a ConfigError naming the plugin, the hook
        and the kind and place of the error (not its message, which could quote a
        secret): one line from `pushgw`, not a traceback. A ConfigError is kept as is.
        """
        key = (name, hook)
        caller = self._callers.get(key)
        if caller is None:
            others = [p for n, p in self.pm.list_name_plugin() if n != name]
            caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
            self._callers[key] = caller
        if hook not in LOAD_HOOKS:
            results = caller(**kwargs)
        else:
            try:
                results = caller(**kwargs)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(
                    [f"plugin '{name}': its {hook} hook raised {kind_and_place(exc)}"]
                ) from None
        return results[0] if results else None

    async def call_async(self, name: str, hook: str, **kwargs: Any) -> Any:
        result = self.call(name, hook, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    def broadcast(self, hook: str, **kwargs: Any) -> list[Any]:
        """Call a broadcast hook on every plugin; results in registration order."""
        results = getattr(self.pm.hook, hook)(**kwargs)
        return list(reversed(results))  # pluggy calls LIFO; report in plugin order

    async def broadcast_async(
        self,
        hook: str,
        *,
        on_error: Callable[[str, Exception], None] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call a broadcast hook whose implementations may be async, each plugin on its own.

        Plugins are called in registration order, each one's awaitable awaited before
        the next plugin is called. A plugin that raises (calling it or awaiting it) is
        logged with its name and the kind of error (or given to `on_error` with the
        plugin's name), and left out of the results: the other plugins are still
        called. Results are in registration order; None results are left out, as
        `broadcast` does.
        """
        out = []
        for name in self.implementers(hook):
            try:
                result = self.call(name, hook, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:
                if on_error is None:
                    _log_hook_failure(name, hook, exc)
                else:
                    on_error(name, exc)
                continue
            if result is not None:
                out.append(result)
        return out

    def migration_dirs(self) -> list[str]:
        """The enabled plugins' migration directories (`pushgw_migrations`), in plugin
        order: the branches `Store.upgrade` applies."""
        dirs = [self.call(name, "pushgw_migrations") for name in self.names]
        return [str(d) for d in dirs if d]

    def implementers(self, hook: str) -> list[str]:
        """Names of the plugins implementing `hook`, in registration order."""
        implementing = {impl.plugin_name for impl in getattr(self.pm.hook, hook).get_hookimpls()}
        return [name for name in self.names if name in implementing]


def _log_hook_failure(plugin: str, hook: str, exc: Exception) -> None:
    """Log the plugin, the hook, the kind of error and where it was raised; never the
    message, which could quote what the hook was given (a token, a payload)."""
    log.error("plugin %s: its %s hook raised %s", plugin, hook, kind_and_place(exc))


def installed_migration_dirs() -> list[str]:
    """The migration directory of every installed plugin, enabled or not: a plugin
    disabled after its branch was applied left its revision in the database, which
    Alembic must be able to locate (`Store.upgrade(known=...)`). A plugin that cannot be
    loaded is left out (its revision, if any, then stays unknown)."""
    dirs = []
    for _name, ep in sorted(_entry_points().items()):
        try:
            hook = getattr(ep.load(), "pushgw_migrations", None)
            found = hook() if callable(hook) else None
        except Exception:
            continue
        if found:
            dirs.append(str(found))
    return dirs


def installed_plugins(enabled: Iterable[str] = ()) -> list[PluginInfo]:
    """Every plugin found through entry points, loaded to list the hooks it implements."""
    enabled_set = set(enabled)
    infos = []
    for name, ep in sorted(_entry_points().items()):
        dist, version = _dist_of(ep)
        try:
            hooks = implemented_hooks(ep.load())
            error = None
        except Exception as exc:
            hooks, error = (), repr(exc)
        infos.append(PluginInfo(name, ep.value, dist, version, hooks, name in enabled_set, error))
    return infos
