"""The contract between the dispatcher and a provider client (APNs, FCM).

A provider client knows one app's credentials and endpoint and turns one `Push`
into one provider request. It classifies the answer into an `Attempt` and never
retries: retries, deadlines, gates and circuit breaking belong to the dispatcher
(one retry policy for the project).
"""

from __future__ import annotations

from typing import Protocol

from gateway.core.push import Attempt, ProviderKind, Push


class ProviderClient(Protocol):
    """One configured app's connection to its provider."""

    kind: ProviderKind
    app_id: str
    # The most requests the lane gives the client at once. A client whose provider says
    # how many it may have open (APNs' SETTINGS_MAX_CONCURRENT_STREAMS) may also define
    # `follow_capacity(listener)`, calling `listener(n)` now and whenever that changes:
    # the lane then gives it at most `n` (never more than `max_in_flight`).
    max_in_flight: int

    def validate(self, push: Push) -> Attempt | None:
        """Check the push before sending (payload size, data types, collapse id...).

        Returns None when it may be sent, else a `permanent` Attempt whose reason is
        `payload_too_large` or `invalid_payload` (or `certificate_expired`: the app's
        APNs certificate is past its expiry) and whose detail says what is wrong.
        """
        ...

    async def start(self) -> None:
        """Open connections / fetch credentials. Called once, inside the running loop."""
        ...

    async def send(self, push: Push) -> Attempt:
        """Make exactly one provider request, bounded by the app's request timeout.

        Never raises for provider or network trouble: a timeout, reset or refused
        connection is a `transient` Attempt. Reuses `push.id` as the request id.
        """
        ...

    async def refresh_credentials(self) -> None:
        """Re-sign the JWT / refetch the OAuth token after an `auth` answer."""
        ...

    def ready(self) -> bool:
        """True when the client can send (credentials loaded)."""
        ...

    async def close(self) -> None:
        """Close connections; pending sends end as transient."""
        ...
