"""Zulip's JSON envelope and the errors the bouncer answers with (specs/zulip.md §1, §2).

Every error is `{"result": "error", "msg": ..., "code": ..., **data}` with
`Content-Type: application/json`. Messages never carry tokens, keys or content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

__all__ = [
    "DEACTIVATED_MSG",
    "ZulipError",
    "error_response",
    "missing_argument",
    "success",
]

DEACTIVATED_MSG = (
    "The mobile push notification service registration for your server has been deactivated"
)


def _dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def success(**fields: Any) -> web.Response:
    """`{"result": "success", "msg": "", ...fields}`, status 200."""
    return web.json_response({"result": "success", "msg": "", **fields}, dumps=_dumps)


class ZulipError(Exception):
    """An error answer in Zulip's envelope.

    `data` fields are added to the body (`var_name`, `hostname`, `retry-after`...);
    `headers` to the response.
    """

    def __init__(
        self,
        msg: str,
        code: str = "BAD_REQUEST",
        status: int = 400,
        data: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(msg)
        self.msg = msg
        self.code = code
        self.status = status
        self.data = dict(data or {})
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        return error_response(self)

    def __repr__(self) -> str:
        return f"ZulipError({self.status}, {self.code!r}, {self.msg!r})"


def error_response(error: ZulipError) -> web.Response:
    body = {"result": "error", "msg": error.msg, "code": error.code, **error.data}
    return web.json_response(body, status=error.status, headers=error.headers, dumps=_dumps)


def missing_argument(name: str) -> ZulipError:
    return ZulipError(
        f"Missing '{name}' argument", "REQUEST_VARIABLE_MISSING", data={"var_name": name}
    )


def method_not_allowed(allowed: list[str]) -> ZulipError:
    """A known endpoint asked with another method: 405 with `Allow` (RFC 9110), and the
    `allowed_methods` of Zulip's own answer (`json_method_not_allowed`)."""
    return ZulipError(
        "Method Not Allowed",
        status=405,
        data={"allowed_methods": allowed},
        headers={"Allow": ", ".join(allowed)},
    )


def unauthorized(msg: str) -> ZulipError:
    return ZulipError(msg, "UNAUTHORIZED", 401, headers={"WWW-Authenticate": 'Basic realm="zulip"'})


# Fixed messages quoted by the spec.
INVALID_REGISTRATION = "Invalid encrypted_push_registration"
ORG_NOT_REGISTERED = "Organization not registered"
REALM_MISMATCH = (
    "Your organization is registered to a different Zulip server. Please contact Zulip "
    "support for assistance in resolving this issue."
)
E2EE_ONLY = "This push notification service only relays end-to-end encrypted notifications"
REGISTRATION_CLOSED = "Registration is not open on this push notification service"


def invalid_registration() -> ZulipError:
    return ZulipError(INVALID_REGISTRATION)


def missing_remote_realm() -> ZulipError:
    return ZulipError(ORG_NOT_REGISTERED, "MISSING_REMOTE_REALM", 403)


def realm_mismatch() -> ZulipError:
    return ZulipError(REALM_MISMATCH, "REMOTE_REALM_SERVER_MISMATCH_ERROR", 403)


def push_disallowed(reason: str) -> ZulipError:
    return ZulipError(
        "Your plan doesn't allow sending push notifications. "
        f"Reason provided by the server: {reason}",
        "PUSH_NOTIFICATIONS_DISALLOWED",
    )
