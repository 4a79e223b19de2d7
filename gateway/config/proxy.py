"""The proxy of the provider clients: `delivery.proxy`, else the `HTTPS_PROXY` variable.

Both are checked at load (`proxy_problem`): the clients tunnel through HTTP CONNECT
only, and a proxy they cannot use (`socks5://`, `https://`, no host, a bad port) would
otherwise pass `check-config` and end `serve` with a traceback from the APNs client, or
fail every FCM push. Messages never quote the URL: it may carry a user name and password.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Mapping
from urllib.parse import urlsplit

PROXY_ENV = ("HTTPS_PROXY", "https_proxy")
"""The variables of the proxy used when `delivery.proxy` is not set, first set wins."""

_EXPECTED = "expected an HTTP CONNECT proxy, http://[user:password@]host[:port]"


def proxy_problem(value: str) -> str | None:
    """Why the provider clients cannot use the proxy URL `value`, or None.

    The message quotes nothing of `value`, not even its scheme: without "://",
    `user:password@proxy` reads as scheme "user".
    """
    try:
        parts = urlsplit(value)
        port = parts.port  # ValueError unless a number from 0 to 65535
    except ValueError:
        return f"not a URL, or its port is not a number from 1 to 65535: {_EXPECTED}"
    if parts.scheme != "http":
        return f"only http:// proxies are supported: {_EXPECTED}"
    if not parts.hostname:
        return f"no host: {_EXPECTED}"
    if port == 0:
        return f"port 0 is not a port to connect to: {_EXPECTED}"
    return None


def environment_proxy(
    url: str | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, str] | None:
    """(variable, value) of the `HTTPS_PROXY` proxy, or None: none set, or `NO_PROXY`
    exempts the host of `url` (every host, when `url` is None, with `NO_PROXY=*`)."""
    environ = os.environ if environ is None else environ
    found = next(((name, environ[name]) for name in PROXY_ENV if environ.get(name)), None)
    if found is None:
        return None
    no_proxy = environ.get("no_proxy") or environ.get("NO_PROXY") or ""
    if url is None:
        return None if no_proxy.strip() == "*" else found
    host = urlsplit(url).hostname or ""
    if no_proxy and urllib.request.proxy_bypass_environment(  # type: ignore[attr-defined]
        host, {"no": no_proxy}
    ):
        return None
    return found
