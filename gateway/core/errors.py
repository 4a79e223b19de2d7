"""Saying what went wrong without saying what the error says."""

from __future__ import annotations

import traceback


def kind_and_place(exc: BaseException) -> str:
    """`RuntimeError at /path/plugin.py:12`: the kind of error and where it was raised,
    never its message, which could quote what the failing code was given or read (a
    token, a payload, a key, a database statement's parameters)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}{where}"
