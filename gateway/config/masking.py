"""Masking: the normalized config as plain data with every secret masked
(what `pushgw check-config` prints), and URLs with their passwords masked (`mask_url`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

from pydantic import BaseModel

from gateway.config.base import SECRETS_FROM_FILES_MASK
from gateway.config.sections import Settings

MASK = "**********"


def masked(settings: Settings, plugin_sections: Mapping[str, BaseModel]) -> dict[str, Any]:
    """The normalized config as plain data, with every secret masked: each value read
    from an `X_file` (`ConfigModel`), and each with a secret's name (`_mask`)."""
    from_files = {SECRETS_FROM_FILES_MASK: MASK}
    out = settings.model_dump(mode="json", by_alias=True, exclude={"plugins"}, context=from_files)
    plugins: dict[str, Any] = {"enabled": list(settings.plugins.enabled)}
    for name, section in plugin_sections.items():
        plugins[name] = section.model_dump(mode="json", context=from_files)
    out["plugins"] = plugins
    return _mask(out)


_SECRET_WORDS = ("secret", "password", "hmac_key", "private", "token", "key")
_NOT_SECRET = {"key_id", "keyfile", "push_key_id", "public_key", "keys"}


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return lowered not in _NOT_SECRET and any(w in lowered for w in _SECRET_WORDS)


def _mask(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _mask(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, key) for v in value]
    if not (isinstance(value, str) and value):
        return value
    lowered = key.lower()
    if _secret_name(lowered) and not lowered.endswith(("_file", "_uri", "_url")):
        return MASK
    return mask_url(value)


# A user name as SQLAlchemy reads one (anything up to the first ":" that is not a "/"),
# then the ":" that starts the password. RFC 3986 allows less, but a password that some
# reader would take as one is masked.
_USER_AND_COLON = re.compile(r"[^:/]*:")


def mask_url(value: str) -> str:
    """`value` with the password of a URL in it (and secret-named query values) masked.

    `postgresql+asyncpg://pushgw:S3cret@db/pushgw` -> `postgresql+asyncpg://pushgw:***@db/pushgw`:
    scheme, user, host and path stay, so that the output stays useful.

    The password runs from the first ":" after the user name to the LAST "@": a password
    with an unencoded "@" (`u:p@ss@db`) is masked whole, not cut at its first "@", and so
    is one of a URL no parser reads (`http://u:pw@[::1/`). Everything between them is
    masked when in doubt (an "@" in a path or query after a password, or after a port).
    """
    scheme, sep, rest = value.partition("://")
    if not sep:
        return value
    user = _USER_AND_COLON.match(rest)
    last_at = rest.rfind("@")
    if user and last_at >= user.end():
        rest = f"{rest[: user.end()]}***{rest[last_at:]}"
    head, qmark, query = rest.partition("?")
    if qmark:
        fragment_sep = "#" if "#" in query else ""
        query, _, fragment = query.partition("#")
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_secret_name(k) for k, _ in pairs):
            query = urlencode([(k, "***" if _secret_name(k) else v) for k, v in pairs], safe="*")
        rest = f"{head}?{query}{fragment_sep}{fragment}"
    return f"{scheme}://{rest}"
