"""What the gateway hands to plugins: `PluginContext`, the `Service` protocol, `CommandContext`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.core.dispatcher import Dispatcher
    from gateway.core.metrics import Metrics
    from gateway.core.push import Push, Receipt
    from gateway.core.receipts import ReceiptWriter
    from gateway.core.store import Store


WORKER_ENV = "PUSHGW_WORKER"  # index of this process among `--workers N`


def first_worker() -> bool:
    """True in the first (or only) worker process."""
    return os.environ.get(WORKER_ENV, "0") == "0"


@runtime_checkable
class Service(Protocol):
    """A plugin's background service with a lifecycle (relay listener, periodic job...)."""

    name: str

    async def start(self) -> None:
        """Start the service; return once it runs (spawn tasks, don't block)."""
        ...

    async def stop(self) -> None:
        """Stop it and wait for its tasks; must be idempotent."""
        ...

    def ready(self) -> bool:
        """Whether the service is doing its job now (reported by /readyz)."""
        ...


# A service may also define:
# - `status() -> Mapping[str, Any]`: JSON-ready detail that /readyz shows under
#   `service_status` (per-relay connection state, say);
# - `one_per_gateway = True`: with `--workers N`, run it in the first worker only
#   (a listener whose every event must be handled exactly once, like a relay subscription).


class TokenHasher:
    """Keyed hash of device tokens: the only form in which a token may be persisted by the core.

    The same value appears in receipts (`token_hash`) so that analytics results can be
    fed back to the plugin that owns the token.
    """

    def __init__(self, key: bytes) -> None:
        # Keyed once: copying the keyed state is cheaper than keying it per token.
        self._keyed = hmac.new(key, digestmod="sha256")

    def __call__(self, token: str) -> str:
        mac = self._keyed.copy()
        mac.update(token.encode())
        return mac.hexdigest()


class NotRunning(RuntimeError):
    """A runtime handle was used before the gateway started (or after it stopped)."""


@dataclasses.dataclass
class Runtime:
    """The live handles of a running gateway, filled in as start-up proceeds."""

    settings: Settings
    hasher: TokenHasher
    metrics: Metrics
    store: Store | None = None
    dispatcher: Dispatcher | None = None
    receipts: ReceiptWriter | None = None


class PluginContext:
    """One plugin's view of the gateway; passed to every per-plugin hook.

    Attributes: `name` (the plugin's registered name), `config` (its validated config
    section, or None), `settings` (the whole validated core configuration), `state` (a
    dict the plugin owns, to share objects between its hooks instead of module globals).
    Handles (`dispatcher`, `store`) exist once the gateway runs; using them while
    the application is still being built raises `NotRunning`.
    """

    def __init__(self, name: str, config: Any, runtime: Runtime) -> None:
        self.name = name
        self.config = config
        self.state: dict[str, Any] = {}
        self._runtime = runtime

    @property
    def settings(self) -> Settings:
        return self._runtime.settings

    @property
    def metrics(self) -> Metrics:
        """The gateway's one metrics registry (`metrics.registry`) for plugin metrics."""
        return self._runtime.metrics

    @property
    def store(self) -> Store:
        if self._runtime.store is None:
            raise NotRunning("the store is not open yet")
        return self._runtime.store

    @property
    def dispatcher(self) -> Dispatcher:
        if self._runtime.dispatcher is None:
            raise NotRunning("the dispatcher is not running yet")
        return self._runtime.dispatcher

    def token_hash(self, token: str) -> str:
        """The keyed hash receipts carry for `token` (to find records by receipt)."""
        return self._runtime.hasher(token)

    async def send(self, push: Push) -> Receipt:
        """Deliver `push` through the core and wait for its final `Receipt`."""
        push.plugin = self.name
        return await self.dispatcher.send(push)

    def submit(self, push: Push) -> asyncio.Task[Receipt]:
        """Deliver `push` in the background; the task's result is its `Receipt`."""
        push.plugin = self.name
        return self.dispatcher.submit(push)


class CommandContext:
    """Given to CLI sub-command handlers: loads the config and opens the store on demand."""

    def __init__(self, config_path: str | None, loader: Callable[[str | None], Any]) -> None:
        self.config_path = config_path
        self._loader = loader
        self._loaded: Any = None

    def load(self) -> Any:
        """The loaded gateway (`gateway.app.LoadedGateway`): settings, plugins, contexts."""
        if self._loaded is None:
            self._loaded = self._loader(self.config_path)
        return self._loaded

    def plugin_section(self, name: str) -> dict[str, Any]:
        """A plugin's config section as written (file plus `PUSHGW__...` overrides), not
        validated against the plugin's model.

        For commands that create or repair what their section points at: validating the
        section reads a `*_file` key's file, so a file that does not exist yet, or holds
        the very entry the command is to remove, would refuse the command that fixes it.
        The core sections are still validated (`ConfigError`).
        """
        if self._loaded is not None:
            return dict(self._loaded.settings.plugins.section(name))
        from gateway.config import load_settings  # only commands need the loader here

        return load_settings(self.config_path).plugins.section(name)

    @contextlib.asynccontextmanager
    async def open_store(self) -> AsyncIterator[Store]:
        """The configured store, migrated as at start-up (when `store.auto_upgrade`),
        else checked to be at head.

        Opened as the core's commands open it: a database that is unreachable, refuses
        or is not migrated raises `gateway.cli.DatabaseError` (one line, password masked;
        `pushgw` reports it with exit status 1), an unusable `store.url` a `ConfigError`
        (status 2). While it is open, plugin contexts' `store` handles work too.
        """
        from gateway.cli import opened_store  # gateway.cli imports this module

        loaded = self.load()
        async with opened_store(loaded, migrate=loaded.settings.store.auto_upgrade) as store:
            yield store
