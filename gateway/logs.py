"""Logging: plain or JSON lines, with the request id of the current request on every line.

What may be logged is decided where a message is written: the core logs app ids,
plugin names, reasons and counts, never tokens, keys or notification content.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

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


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
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


def configure(level: str = "INFO", json_format: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    quiet_third_party(level)


def quiet_third_party(level: str | int = logging.DEBUG) -> None:
    """Hold the `QUIET_LOGGERS` at WARNING, or at `level` when that is higher."""
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, numeric))
