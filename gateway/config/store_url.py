"""What `store.url` may carry beyond its driver: the query parameters each driver takes
from a URL (with their values checked) and port numbers.

Written by hand because no library says it: asyncpg fails on an unknown keyword
(`sslmode`) only when it connects, in the middle of `pushgw db upgrade`, and SQLAlchemy
hands every query value on as a string, which several of asyncpg's keywords cannot take.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

_Check = Callable[[tuple[str, ...]], str | None]
"""Checks the values of one query parameter (several when it is repeated): the problem,
or None."""


def _once(check: Callable[[str], str | None]) -> _Check:
    def run(values: tuple[str, ...]) -> str | None:
        return "given more than once" if len(values) > 1 else check(values[0])

    return run


def _choice(*choices: str) -> _Check:
    expected = f"expected {', '.join(choices[:-1])} or {choices[-1]}"
    return _once(lambda value: None if value in choices else expected)


def _seconds(value: str) -> str | None:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if math.isfinite(seconds) and seconds > 0:
        return None
    return "expected a number of seconds greater than 0"


def _count(value: str) -> str | None:
    return None if re.fullmatch(r"[0-9]+", value) else "expected a whole number, 0 or more"


def port_problem(port: int) -> str | None:
    return None if 0 <= port <= 65535 else f"port {port} is out of range (0-65535)"


def _ports(values: tuple[str, ...]) -> str | None:
    """`port=5432`, or `port=5432,5433` with one port per host of `host=db1,db2`."""
    for port in (p for value in values for p in value.split(",")):
        if not port:
            continue  # the default port, as SQLAlchemy reads an empty one
        if not re.fullmatch(r"[0-9]+", port):
            return "expected port numbers (0-65535), comma-separated"
        if problem := port_problem(int(port)):
            return problem
    return None


def _hosts(values: tuple[str, ...]) -> str | None:
    """`host=/run/postgresql` (a socket directory), `host=db:5432`, `host=db1,db2`, or
    the parameter repeated (`host=db1:5432&host=db2:5433`): their ports checked."""
    if len(values) > 1 and any(value.count(":") > 1 for value in values):
        # SQLAlchemy splits each at ":" (and fails on an IPv6 address)
        return "expected HOST or HOST:PORT where host is repeated"
    for host in (h for value in values for h in value.split(",")):
        # HOST:PORT or [IPV6]:PORT; a bare IPv6 address or a socket path has no port
        parts = re.fullmatch(r"(\[[^\]]*\]|[^:/\[\]]*):([^:]*)", host)
        if not parts or not parts[2]:
            continue
        if not re.fullmatch(r"[0-9]+", parts[2]):
            return "expected HOST or HOST:PORT, comma-separated"
        if problem := port_problem(int(parts[2])):
            return problem
    return None


_TEXT = _once(lambda value: None)

_QUERY_PARAMETERS: dict[str, dict[str, _Check]] = {
    # The keyword arguments of asyncpg.connect() that work as text from a URL (SQLAlchemy
    # passes each query parameter on as a string; prepared_statement_cache_size is its own,
    # made an int), host and port as SQLAlchemy reads them (several hosts, a socket
    # directory). Not: timeout, statement_cache_size and asyncpg's other numbers, which
    # fail as text; direct_tls, where "false" is true; server_settings (a mapping);
    # service and servicefile (newer than the asyncpg pushgw requires).
    "postgresql+asyncpg": {
        "command_timeout": _once(_seconds),
        "gsslib": _choice("gssapi", "sspi"),
        "host": _hosts,
        "krbsrvname": _TEXT,
        "passfile": _TEXT,
        "port": _ports,
        "prepared_statement_cache_size": _once(_count),
        "ssl": _choice("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
        "target_session_attrs": _choice(
            "any", "primary", "standby", "prefer-standby", "read-write", "read-only"
        ),
    },
    # None of pysqlite's (timeout, isolation_level, detect_types, check_same_thread,
    # cached_statements, uri): they would do nothing (the store sets busy_timeout itself),
    # get in the way of the store's own settings, or change how the path is read.
    "sqlite+aiosqlite": {},
}
"""The query parameters `store.url` accepts, per driver, with the check of their values.
Anything else is refused: asyncpg fails on an unknown keyword (`sslmode`) only when it
connects, in the middle of `pushgw db upgrade`."""

_HINTS = {("postgresql+asyncpg", "sslmode"): " (asyncpg's name for it is ssl)"}


def query_problem(drivername: str, query: Mapping[str, str | tuple[str, ...]]) -> str | None:
    accepted = _QUERY_PARAMETERS[drivername]
    for key, value in query.items():
        if key not in accepted:
            hint = _HINTS.get((drivername, key), "")
            listed = ", ".join(sorted(accepted)) if accepted else "none"
            sep = ":" if accepted else ""
            return f"unknown query parameter {key!r}{hint}; {drivername} accepts{sep} {listed}"
        problem = accepted[key]((value,) if isinstance(value, str) else tuple(value))
        if problem:
            return f"query parameter {key}: {problem}"
    return None
