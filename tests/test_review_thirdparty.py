"""Found while writing a third-party plugin from docs/plugins.md alone.

Each test is a framework behaviour a plugin author met that contradicted the docs or
failed in a way the docs promise it does not (a traceback, a secret shown, a hook's
result silently dropped); each failed before its fix.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from gateway.api import hookimpl
from gateway.testing.harness import GatewayHarness, base_config
from gateway.testing.relay import free_port
from tests.conftest import install_plugin_dist
from tests.test_cli import run


def installed(tmp_path: Path, name: str, source: str) -> dict[str, str]:
    """`pushgw_NAME` as an installed plugin distribution, for a `pushgw` subprocess."""
    site = tmp_path / "site"
    install_plugin_dist(site, name)
    (site / f"pushgw_{name}.py").write_text(source)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.getcwd()])}


# --- check-config shows a secret read through `X_file` --------------------------------

SECRET_PLUGIN = """
from gateway.api import ConfigModel, hookimpl

class Config(ConfigModel):
    bearer: str = ""          # an API credential, read with bearer_file

@hookimpl
def pushgw_config_model():
    return Config
"""


def test_check_config_masks_a_plugin_secret_read_from_a_file(tmp_path: Path) -> None:
    """docs/configuration.md: "wherever a model has a secret `X`, `X_file: PATH` reads it
    from a file", and check-config prints the configuration "with secrets masked". A
    value that came from `X_file` is a secret by the operator's own statement, whatever
    the field is called; today it is masked only when its name contains a word of a
    fixed list (key, secret, token...), so `bearer_file`'s content is printed."""
    env = installed(tmp_path, "rvsecret", SECRET_PLUGIN)
    secret = tmp_path / "bearer.txt"
    secret.write_text("Bearer-S3cr3t-value\n")
    path = tmp_path / "pushgw.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "plugins": {
                    "enabled": ["rvsecret"],
                    "rvsecret": {"bearer_file": str(secret)},
                },
            }
        )
    )
    result = run("check-config", "--config", str(path), env=env)
    assert result.returncode == 0, result.stderr
    assert "Bearer-S3cr3t-value" not in result.stdout


# --- pushgw serve: a migration failure at start-up is a traceback ---------------------


def test_a_migration_failure_at_serve_start_up_is_one_line(tmp_path: Path) -> None:
    """A database holding the revision of a plugin that was uninstalled since (or a
    plugin migration that fails): `pushgw db upgrade` and `serve --workers 2` say so in
    one line (status 1), but `pushgw serve` with one worker migrates inside the app's
    start-up, outside the core's database error handling, and dies with a ~100-line
    Alembic traceback. docs/cli.md: never a traceback; a database that cannot be used is
    `pushgw: error: database URL: reason`, status 1."""
    db = tmp_path / "db.sqlite"
    with sqlite3.connect(db) as conn:  # a branch applied by a plugin no longer installed
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('gone_0001')")
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump({"store": {"url": f"sqlite+aiosqlite:///{db}"}}))

    upgrade = run("db", "upgrade", "--config", str(path))
    assert upgrade.returncode == 1
    assert upgrade.stderr.startswith("pushgw: error: database ")  # the promised one line

    result = run("serve", "--config", str(path), "--port", str(free_port()), "--workers", "1")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("pushgw: error: database ")


# --- a plugin command that raises ----------------------------------------------------

RAISING_COMMAND_PLUGIN = """
from gateway.api import hookimpl

def purge(args, command_context):
    raise RuntimeError("could not purge token abcdef0123456789")

@hookimpl
def pushgw_commands(subparsers):
    subparsers.add_parser("rvcmd").set_defaults(handler=purge)
"""


def test_a_plugin_command_that_raises_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """docs/cli.md: errors are one line, "never as a traceback (a traceback is a bug of
    ours)", and an exception is "named by its kind only, never by its message or frames
    (they may quote a token)". Every other plugin hook that raises is contained that
    way (pushgw_commands itself, token-invalid, push-result, load hooks); a command
    handler's exception escapes as a raw traceback quoting its message."""
    env = installed(tmp_path, "rvcmd", RAISING_COMMAND_PLUGIN)
    result = run("rvcmd", env=env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "abcdef0123456789" not in result.stderr
    assert "rvcmd" in result.stderr and "RuntimeError" in result.stderr


# --- hook results that are silently dropped or fail far from the plugin ---------------


class _AsyncRoutes:
    @hookimpl
    async def pushgw_routes(self, context: Any, router: web.UrlDispatcher) -> None:
        async def hello(request: web.Request) -> web.Response:
            return web.Response(text="hello")

        router.add_get("/rv/hello", hello)


async def test_an_async_routes_hook_is_not_silently_ignored(tmp_path: Path) -> None:
    """`async def pushgw_routes` (most hooks may be async; this one may not) returns a
    coroutine that is never awaited: the gateway starts without the plugin's routes and
    every request is a 404. The load hooks reject a coroutine result with an error naming
    the plugin (`its pushgw_apps hook returned coroutine, ...`); this one should too, or
    await it."""
    config = base_config(tmp_path, {"rvasync": {}})
    try:
        async with GatewayHarness(config, extra_plugins={"rvasync": _AsyncRoutes()}) as gw:
            response = await gw.client.get("/rv/hello")
            status = response.status
    except Exception as exc:
        assert "rvasync" in str(exc) and "pushgw_routes" in str(exc)
        return
    assert status == 200, "the plugin's routes were silently dropped"


class _Service:
    name = "rv-service"

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True


class _AsyncServices:
    @hookimpl
    async def pushgw_services(self, context: Any) -> list[_Service]:
        return [_Service()]


class _OneService:
    @hookimpl
    def pushgw_services(self, context: Any) -> _Service:
        return _Service()  # not in a list


@pytest.mark.parametrize("plugin", [_AsyncServices, _OneService], ids=["async", "not-a-list"])
async def test_a_bad_services_hook_result_names_the_plugin(tmp_path: Path, plugin: type) -> None:
    """A pushgw_services result that is not an iterable of services (a coroutine from an
    `async def` hook, a single service) ends start-up with a bare `TypeError: 'coroutine'
    object is not iterable` raised in gateway/app.py, naming neither the plugin nor the
    hook; pushgw_apps / pushgw_config_model results are checked and named."""
    config = base_config(tmp_path, {"rvsvc": {}})
    try:
        async with GatewayHarness(config, extra_plugins={"rvsvc": plugin()}) as gw:
            body = await (await gw.client.get("/readyz")).json()
    except Exception as exc:
        assert "rvsvc" in str(exc) and "pushgw_services" in str(exc), repr(exc)
        return
    assert body["services"] == {"rv-service": True}


def _route_plugin(method: str, path: str, text: str, *extra: str) -> object:
    class Plugin:
        @hookimpl
        def pushgw_routes(self, context: Any, router: web.UrlDispatcher) -> None:
            async def handler(request: web.Request) -> web.Response:
                return web.Response(text=text)

            for route in (path, *extra):
                getattr(router, f"add_{method}")(route, handler)

    return Plugin()


@pytest.mark.parametrize(
    "plugins",
    [
        # shadowed by the core's GET /readyz: the plugin's handler never runs, no error
        {"rvp": _route_plugin("get", "/readyz", "p")},
        # two plugins, same path, another route in between: the second never runs, no error
        {
            "rvp": _route_plugin("post", "/rv/x", "p", "/rv/y"),
            "rvq": _route_plugin("post", "/rv/x", "q"),
        },
        # same, adjacent: aiohttp's RuntimeError, naming neither the plugin nor the path
        {"rvp": _route_plugin("post", "/rv/x", "p"), "rvq": _route_plugin("post", "/rv/x", "q")},
    ],
    ids=["core-route", "other-plugin", "other-plugin-adjacent"],
)
async def test_a_route_collision_is_an_error_naming_the_plugin(
    tmp_path: Path, plugins: dict[str, object]
) -> None:
    """hookspecs: routes "must not collide with another plugin's or the core's". Nothing
    checks it: depending on route order a colliding route is silently never executed, or
    start-up fails with aiohttp's "Added route will never be executed, method POST is
    already registered" (which plugin? which path?)."""
    config = base_config(tmp_path, {name: {} for name in plugins})
    with pytest.raises(Exception) as failed:
        async with GatewayHarness(config, extra_plugins=plugins):
            pass
    last = list(plugins)[-1]
    assert last in str(failed.value), repr(failed.value)
