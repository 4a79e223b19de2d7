"""Transport pieces shared by the provider clients: trust store, proxy, Retry-After."""

from __future__ import annotations

import datetime
import email.utils
import math
import os
import ssl
import time
from pathlib import Path
from urllib.parse import urlsplit

from gateway.config.proxy import environment_proxy


def ca_bundle(*candidates: Path | None) -> Path | None:
    """The first configured trust store, else `SSL_CERT_FILE`, else None (system default)."""
    for candidate in candidates:
        if candidate is not None:
            return candidate
    env = os.environ.get("SSL_CERT_FILE")
    return Path(env) if env else None


def ssl_context(ca_file: Path | None, *, alpn: list[str] | None = None) -> ssl.SSLContext:
    """A verifying client context trusting `ca_file` (or the system store when None)."""
    ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def resolve_proxy(explicit: str | None, url: str) -> str | None:
    """The HTTP CONNECT proxy for `url`: the configured one, else `HTTPS_PROXY` unless
    `NO_PROXY` exempts the host. Resolved once per client, never per request.

    Both were checked at load (`gateway.config.proxy.proxy_problem`)."""
    if explicit:
        return explicit
    found = environment_proxy(url)
    return found[1] if found else None


def printable(text: str) -> str:
    """`text` with each character that is not printable as "?": what a proxy or an
    upstream wrote (a CONNECT refusal's reason phrase), quoted in a log line or a
    `detail`. A carriage return, a NEL or a vertical tab in it split the log line (the
    journal made each piece an entry of its own), and escape sequences reached the
    terminal of whoever read the log."""
    return "".join(char if char.isprintable() else "?" for char in text)


def proxy_label(proxy: str) -> str:
    """`host:port` of the proxy URL `proxy`, for errors and logs: never its user name
    or password (`http://user:pw@proxy:3128` gives `proxy:3128`). Checked at load."""
    parts = urlsplit(proxy)
    host = parts.hostname or "?"
    try:
        port = parts.port or 80
    except ValueError:
        port = 80
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_retry_after(value: str | bytes | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` value (delta seconds or HTTP-date).

    None for an absent or unparseable value: a provider's malformed header is ignored
    (the dispatcher's own backoff applies), never an exception. Only ASCII is read:
    `"\u00b2"` passes `str.isdigit()` and `"\u0661"` passes `float()`, and neither is
    a delta-seconds of RFC 9110.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip()
    if not value or not value.isascii():
        return None
    try:
        seconds = float(value)  # delta-seconds, and the decimals some servers send
    except ValueError:
        pass
    else:
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when is None:
            return None
        if when.tzinfo is None:
            # The asctime form (and "-0000") carries no zone: an HTTP-date is always
            # GMT (RFC 9110 section 5.6.7), never the host's local time.
            when = when.replace(tzinfo=datetime.UTC)
        return max(when.timestamp() - (time.time() if now is None else now), 0.0)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
