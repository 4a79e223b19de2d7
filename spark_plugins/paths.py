"""Paths the jobs are given or Spark lists: local paths, `file:` URIs, Hadoop URIs."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse


def display_path(uri: str) -> str:
    """`file:/x/y%20z.jsonl` -> `/x/y z.jsonl`; other URIs unchanged."""
    if uri.startswith("file:"):
        return unquote(urlparse(uri).path)
    return uri


def is_local(path: str) -> bool:
    """A plain path or a `file:` URI (anything else only Spark can look at)."""
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def uri_path(uri: str) -> str:
    """The local path of a URI as Spark lists it (percent-encoded): `file:/a%20b` -> `/a b`."""
    return unquote(urlparse(uri).path) if uri.startswith("file:") else uri


def arg_path(path: str) -> str:
    """The local path of a path as an operator gives it (`--out`): `file:` stripped, the
    rest as typed, as Hadoop's `Path` takes it."""
    return path[len("file:") :] if path.startswith("file:") else path
