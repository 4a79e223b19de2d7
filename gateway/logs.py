"""Logging: plain or JSON lines, with the request id of the current request on every line.

What may be logged is decided where a message is written: the core logs app ids,
plugin names, reasons and counts, never tokens, keys or notification content.
Tracebacks are the one thing no call site controls: an exception's message may quote
what the failing code was given (a token in a plugin's error, SQL parameters in a
database error). So every formatter here prints a traceback's frames and exception
types, never the messages (`redacted_traceback`).
"""

from __future__ import annotations

import contextvars
import ipaddress
import json
import logging
import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp.abc import AbstractAccessLogger, BaseRequest, StreamResponse
from aiohttp.web_urldispatcher import AbstractResource

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

# Libraries that log what the gateway must not: request URLs and headers with device
# tokens (HTTP clients), SQL statements with their parameters (database drivers),
# relay frames (websockets), the JVM bridge's commands (py4j). They stay at WARNING
# whatever the gateway's own level, so `logging.level: DEBUG` debugs pushgw, not them.
QUIET_LOGGERS = (
    "aioapns",
    "h2",
    "hpack",
    "httpx",
    "httpcore",
    "urllib3",
    "google",
    "asyncio",
    "aiosqlite",
    "asyncpg",
    "sqlalchemy",
    "py4j",
    "websockets",
)


class RouteAccessLogger(AbstractAccessLogger):
    """`logging.access_log`: one line per request naming the route's pattern
    (`/devices/{pushkey}`), never the request's path, query or Referer.

    aiohttp's own access log writes the request line, query string included, and its
    format has no directive for less: device tokens travel in query strings (form
    fields) and may travel in paths. A request that matched no route is `unmatched`.
    """

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        version = f"HTTP/{request.version.major}.{request.version.minor}"
        self.logger.info(
            '%s "%s %s %s" %d %d %.3fs "%s"',
            client_address(request.remote),
            request.method,
            route_pattern(request),
            version,
            response.status,
            response.body_length,
            time,
            request.headers.get("User-Agent", "-"),
        )


def client_address(remote: str | None) -> str:
    """The client's address as the operator knows it: an IPv4 client of a dual-stack
    socket (`server.host: "::"`) is `192.0.2.1`, not `::ffff:192.0.2.1`, so that the log's
    addresses match firewall rules and proxy logs whichever socket took the connection."""
    if not remote:
        return "-"
    try:
        mapped = ipaddress.IPv6Address(remote).ipv4_mapped
    except ValueError:  # IPv4, or not an address (a Unix socket's peer)
        return remote
    return str(mapped) if mapped is not None else remote


def route_pattern(request: BaseRequest) -> str:
    """The pattern of the route that answered (`/devices/{pushkey}`), `unmatched` when none
    did (a 404, a 405, a request not yet routed): what metrics and the access log name a
    request by, never its path."""
    try:
        match_info = getattr(request, "match_info", None)  # a web.Request's, once routed
    except AssertionError:
        # aiohttp asserts it is set: the request of its parser's 400 (a request it could
        # not parse) never was, and the access logger raised a traceback per such request.
        match_info = None
    resource = getattr(getattr(match_info, "route", None), "resource", None)
    return resource.canonical if isinstance(resource, AbstractResource) else "unmatched"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def redacted_traceback(exc: BaseException) -> str:
    """The traceback of `exc` and the exceptions chained to it: frames and exception
    types, each message replaced by a note that it was withheld."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    parts: list[str] = []
    for item in reversed(chain):
        if parts:
            parts.append("\nwhich led to:\n")
        parts.append("Traceback (most recent call last):\n")
        parts.extend(traceback.format_list(traceback.extract_tb(item.__traceback__)))
        kind = type(item)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        parts.append(f"{name} (message withheld: it may quote tokens or content)")
    return "".join(parts)


class RedactingFormatter(logging.Formatter):
    """A `logging.Formatter` whose tracebacks leave out exception messages, and whose
    `%(asctime)s` is UTC, `2025-01-01T12:00:00.123Z`."""

    # logging's default is the machine's local time without its offset: under
    # TZ=Pacific/Chatham a line read 13:45 ahead of the JSON lines, receipts and reports
    # (all UTC), and nothing on it said so.
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    @staticmethod
    def converter(seconds: float | None = None) -> time.struct_time:
        return time.gmtime(seconds)

    def format(self, record: logging.LogRecord) -> str:
        # `logging.Formatter` caches the traceback text on the record, and another
        # handler's formatter (with messages) may have filled that cache first.
        cached, record.exc_text = record.exc_text, None
        try:
            return super().format(record)
        finally:
            record.exc_text = cached

    def formatException(self, ei: Any) -> str:
        exc = ei[1]
        return redacted_traceback(exc) if exc is not None else super().formatException(ei)


class OneLineFormatter(logging.Formatter):
    """`pushgw: warning: ...`, one line per record, for commands other than `serve`: an
    exception is named by its kind, never by its frames or its message."""

    def format(self, record: logging.LogRecord) -> str:
        line = record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            line += f" ({type(error).__name__})"
        return f"pushgw: {record.levelname.lower()}: {line}"


JOURNAL_ENV = "JOURNAL_STREAM"
"""Set by systemd to `DEVICE:INODE` of the journal stream it gave as stdout/stderr."""

# syslog(3) priorities, as journald reads them from a line's `<N>` prefix
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


def stderr_is_journal() -> bool:
    """Whether stderr is systemd's journal stream (sd_journal_stream_fd's protocol): the
    `$JOURNAL_STREAM` systemd sets names the very file stderr is, not one a child
    process inherited the variable from while its stderr went elsewhere."""
    value = os.environ.get(JOURNAL_ENV)
    if not value:
        return False
    try:
        stat = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no stderr, or not a real file
        return False
    return value == f"{stat.st_dev}:{stat.st_ino}"


class JournalFormatter(RedactingFormatter):
    """Plain lines for journald: no timestamp (the journal stamps each line itself, so
    `journalctl` showed two), and a `<N>` syslog priority prefix on every line, a
    traceback's included, so that `journalctl -p warning` picks the warnings and
    errors out."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s [%(request_id)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        priority = next((p for level, p in _PRIORITIES if record.levelno >= level), 7)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())


class JsonFormatter(RedactingFormatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


class UnreadableBodyFilter(logging.Filter):
    """One line instead of aiohttp's "Unhandled exception" traceback for a request body
    that cannot be read (a `Content-Encoding` it does not decode).

    The handler already answered such a request (400, or 405 for a route that takes no
    body); aiohttp then drains the body to keep the connection, meets the same error
    again and logs it as if it were a bug of ours (aio-libs/aiohttp#1918). A client's
    mistake is an INFO line, never a traceback.

    Likewise a request that aiohttp's parser refuses (a bad method, a header line too long,
    bytes that are not HTTP): aiohttp answers 400 and logs "Error handling request" as an
    ERROR traceback, some twenty lines per hostile connection. One INFO line instead,
    naming the kind of error only: its message quotes the request line (a token in a path).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web import RequestPayloadError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, RequestPayloadError):
            record.msg, record.args = "a request body could not be read: connection closed", ()
        elif isinstance(error, HttpProcessingError):
            record.msg = "a request could not be parsed (%s): answered 400"
            record.args = (type(error).__name__,)
        else:
            return True
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_UNREADABLE_BODY = UnreadableBodyFilter()


def configure(level: str = "INFO", json_format: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_format:
        handler.setFormatter(JsonFormatter())
    elif stderr_is_journal():
        handler.setFormatter(JournalFormatter())
    else:
        handler.setFormatter(
            RedactingFormatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    quiet_third_party(level)
    filter_unreadable_requests()


def filter_unreadable_requests() -> None:
    """Install `UnreadableBodyFilter` on aiohttp's server logger (once, however often
    called): `configure` does, and so does the test harness, whose tests see the log
    lines production writes."""
    logging.getLogger("aiohttp.server").addFilter(_UNREADABLE_BODY)  # the same one: once


def quiet_third_party(level: str | int = logging.DEBUG) -> None:
    """Hold the `QUIET_LOGGERS` at WARNING, or at `level` when that is higher."""
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, numeric))


class RepeatedLines:
    """A line of one kind (`key`) logged at its level at most once per `interval`
    seconds; the repeats meanwhile go to DEBUG and are counted, and the next line at its
    level says how many.

    For lines that would repeat for every push or request for as long as their cause
    lasts (a provider outage, an app no one configured, a bound reached): a WARNING each
    is a flood that hides the line that matters, and /metrics counts every push anyway.
    Keys may hold values clients choose, so at most `max_keys` are kept, the least
    recently logged first out.
    """

    def __init__(
        self,
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 1024,
    ) -> None:
        self.interval = interval
        self.clock = clock
        self.max_keys = max_keys
        # key -> (when logged, repeats since, their summed counts)
        self._last: OrderedDict[tuple[str, ...], tuple[float, int, int]] = OrderedDict()

    def admit(self, key: tuple[str, ...], count: int = 1) -> tuple[int, int] | None:
        """(repeats, their summed counts) not logged since the last line of `key`, or None:
        this one is a repeat, for DEBUG."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1, last[2] + count)
            return None
        self._last[key] = (now, 0, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return (last[1], last[2]) if last is not None else (0, 0)
