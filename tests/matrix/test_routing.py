"""matrix.md §1.3: exact name, then a single glob match; ambiguity rejects."""

from __future__ import annotations

import pytest

from plugins.matrix.routing import AppRouter, RouteError, glob_to_regex


@pytest.mark.parametrize(
    ("glob", "value", "matches"),
    [
        ("com.example.*", "com.example.app", True),
        ("com.example.*", "com.example.", True),
        ("com.example.*", "com.example.a.b.c", True),
        ("com.example.*", "com.exampleXapp", False),
        ("com.example.*", "COM.EXAMPLE.app", False),
        ("com.example.*", "com.example.a\nb", False),
        ("com.?xample", "com.example", True),
        ("com.?xample", "com.xample", False),
        ("a+b(c)", "a+b(c)", True),
        ("a+b(c)", "aab(c)", False),
        ("*", "", True),
    ],
)
def test_glob(glob: str, value: str, matches: bool) -> None:
    assert bool(glob_to_regex(glob).match(value)) is matches


def test_exact_then_glob_then_ambiguity() -> None:
    router = AppRouter(["com.example.a*", "*.example.*", "com.example.abc", "org.other"])
    assert router.route("com.example.abc").app == "com.example.abc"  # exact beats globs
    assert router.route("net.example.x").app == "*.example.*"
    assert router.route("com.example.ax").error is RouteError.AMBIGUOUS
    assert router.route("org.other.x").error is RouteError.UNKNOWN
    assert router.route("org.other").app == "org.other"
    # cached answers are the same
    assert router.route("com.example.ax").error is RouteError.AMBIGUOUS
