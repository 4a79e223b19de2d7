"""Checks made before a server starts, shared by `pushgw serve` and `pushgw simulate`.

Each raises PreflightError, whose `str()` is the reason as the end of one line
(`not a directory`, `not a valid host name (label empty or too long)`): the caller
puts in front what the reason is about (`cannot listen on HOST:PORT: `,
`--state-dir DIR: `) and reports the line as a usage error (status 2). Light on
purpose: `pushgw serve` imports it before anything else starts.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class PreflightError(Exception):
    """An operator mistake found before starting; `str()` is the one-line reason."""


def os_reason(exc: OSError) -> str:
    """`Address already in use` as the end of one line: `address already in use`."""
    reason = exc.strerror or str(exc)
    return f"{reason[:1].lower()}{reason[1:]}"


def resolve(
    host: str, port: int
) -> Sequence[tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]]:
    """`socket.getaddrinfo` for listening (TCP, passive) on `host` and `port`.

    Raises PreflightError when `host` does not resolve, or is no host name at all (an
    empty label, one over 63 characters: the IDNA codec refuses it, as it would in
    `loop.create_server`).
    """
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise PreflightError(os_reason(exc)) from None
    except ValueError as exc:  # UnicodeError: the IDNA codec refused a label of `host`
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        raise PreflightError(f"not a valid host name ({cause})") from None


def check_state_dir(state_dir: Path) -> None:
    """The simulators' state directory: a directory (made when missing) that files can
    be written into, else PreflightError (`not a directory`, `cannot create it: ...`,
    `cannot write into it: ...`)."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # something that is not a directory
        raise PreflightError("not a directory") from None
    except OSError as exc:
        raise PreflightError(f"cannot create it: {os_reason(exc)}") from None
    if not state_dir.is_dir():
        raise PreflightError("not a directory")
    try:
        with tempfile.TemporaryFile(dir=state_dir):
            pass
    except OSError as exc:
        raise PreflightError(f"cannot write into it: {os_reason(exc)}") from None
