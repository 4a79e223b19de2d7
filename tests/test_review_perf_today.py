"""Performance review of today's per-push work: `message_problem` runs for every FCM push,
so it skips the checks that cannot apply and checks each `android.ttl` value once. No
timing here (bench/ measures): these tests count the work done, and pin the answers so
that the faster path says exactly what the slower one said."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from gateway.core import fcm
from gateway.core.fcm import message_problem


class CountingMapping(Mapping[str, Any]):
    """A read-only mapping (not a dict) that records every key looked up in it."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = items
        self.looked_up: list[str] = []

    def __getitem__(self, key: str) -> Any:
        self.looked_up.append(key)
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_android_string_fields_are_not_looked_up_when_none_is_set() -> None:
    # The built-in plugins' FCM messages carry `android: {"priority": ...}` only: the
    # four fields that must be strings were each looked up on every push all the same.
    android = CountingMapping({"priority": "high"})
    assert message_problem({"data": {"k": "v"}, "android": android}) is None
    assert sorted(set(android.looked_up)) == ["priority", "ttl"]


def test_a_set_string_field_is_still_checked_through_the_fast_path() -> None:
    android = CountingMapping({"priority": "high", "restrictedPackageName": 7})
    assert message_problem({"android": android}) == (
        "FCM android.restrictedPackageName must be a string (got int)"
    )


class CountingPattern:
    """Stands in for `fcm.TTL_FORMAT`, counting its full matches."""

    def __init__(self) -> None:
        self.calls = 0

    def fullmatch(self, text: str) -> re.Match[str] | None:
        self.calls += 1
        return fcm.re.fullmatch(r"\d{1,12}(?:\.\d{1,9})?s", text)


def test_the_same_ttl_is_parsed_once_not_on_every_push(monkeypatch: pytest.MonkeyPatch) -> None:
    # An app (Matrix's `fcm_options`) sends the same `android.ttl` on every push.
    pattern = CountingPattern()
    monkeypatch.setattr(fcm, "TTL_FORMAT", pattern)
    ttl = "86399.25s"  # a value no other test uses
    for _ in range(5):
        assert message_problem({"android": {"ttl": ttl, "priority": "normal"}}) is None
    assert pattern.calls <= 1
    for _ in range(3):
        assert message_problem({"android": {"ttl": "86399.25"}}) is not None
    assert pattern.calls <= 2


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ({"data": {}, "android": {}}, None),
        ({"token": "t", "topic": "x", "condition": "c"}, None),  # validate refuses targets
        ({"data": {}, 5: 1}, "FCM message has no field '5'"),
        (
            {"time_to_live": 60, "bogus": 1},
            "FCM message field 'time_to_live' is the legacy API's; in HTTP v1 it is "
            'android.ttl, a duration string such as "3600s"',
        ),
        ({"data": {}, "bogus\n": 1}, "FCM message has no field 'bogus?'"),
        ({"android": ["priority"]}, "FCM android must be an object"),
        ({"android": CountingMapping({"ttl": "60s"})}, None),
        (
            {"android": {"priority": "high", "time_to_live": 60}},
            "FCM android has no field 'time_to_live': use ttl, such as \"3600s\"",
        ),
        ({"android": {"x" * 50: 1}}, f"FCM android has no field '{'x' * 40}'"),
        (
            {"android": {"ttl": 60}},
            'FCM android.ttl must be a duration string such as "3600s" or "3.5s" (got int)',
        ),
        (
            {"android": {"ttl": "60"}},
            'FCM android.ttl must be a duration string such as "3600s" or "3.5s" (got a string)',
        ),
        ({"android": {"ttl": "2419200.5s"}}, "FCM android.ttl is over 2419200s (4 weeks)"),
        (
            {"android": {"ttl": "2419200s", "priority": "urgent"}},
            'FCM android.priority must be "high" or "normal"',
        ),
        (
            {"android": {"restricted_package_name": 1, "collapse_key": 2}},
            "FCM android.collapse_key must be a string (got int)",
        ),
        ({"android": {"collapseKey": None, "priority": None, "ttl": None}}, None),
    ],
)
def test_the_answers_are_those_of_the_field_by_field_check(
    message: dict[Any, Any], problem: str | None
) -> None:
    assert message_problem(message) == problem
