"""Shared fixtures: the spec's vector files and the server key of the Marmot vectors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plugins.marmot.keys import ServerKey

VECTORS = Path("/work/shared/specs/vectors")


def load_vectors(name: str) -> Any:
    """Load one vector file from the shared spec directory."""
    return json.loads((VECTORS / name).read_text("utf-8"))


NIP44 = load_vectors("nip44.vectors.json")["v2"]
MARMOT = load_vectors("marmot.json")
NIP59 = load_vectors("nip59.example.json")
#: ``now`` the derived gift wraps were built for.
VECTOR_NOW = 1767225600


@pytest.fixture
def server_key() -> ServerKey:
    """The Marmot vectors' server key 0x11..11 (odd-Y public key)."""
    return ServerKey(bytes.fromhex(MARMOT["derived"]["token_encryption"]["inputs"]["server_sk"]))


@pytest.fixture(scope="session")
def nostr_relay(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One real nostr-relay process for the session (tests isolate by using fresh server keys)."""
    from .helpers import NostrRelayProcess

    relay = NostrRelayProcess(tmp_path_factory.mktemp("nostr-relay"))
    relay.start()
    yield relay
    relay.stop()
