"""Runs last: no device token or registered secret appeared in any log line of the suite."""

from __future__ import annotations

from tests.conftest import LOG_CAPTURE, SECRETS, SIMULATORS


def _tokens_seen_by_simulators() -> set[str]:
    tokens: set[str] = set()
    for sim in SIMULATORS:
        for request in getattr(sim, "requests", []):
            token = getattr(request, "token", None)
            if token:
                tokens.add(token)
    return tokens


def test_no_token_or_secret_in_any_log_line() -> None:
    secrets = {s for s in _tokens_seen_by_simulators() | SECRETS if len(s) >= 12}
    lines = LOG_CAPTURE.lines
    assert lines, "the suite captured no log lines at all: the capture is broken"
    leaks = [
        (secret[:6] + "…", line[:120]) for secret in secrets for line in lines if secret in line
    ]
    assert not leaks, f"{len(leaks)} log lines carry a token or secret, e.g. {leaks[:3]}"


def test_the_check_sees_the_suite() -> None:
    # Guard against a vacuous pass: the suite pushed real tokens through the simulators.
    assert len(_tokens_seen_by_simulators()) >= 10
