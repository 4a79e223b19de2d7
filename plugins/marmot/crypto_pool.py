"""Unwrapping and chunk decryption in worker processes (config ``crypto_processes``).

A 32-chunk trigger costs ~2.2 ms of CPU in unwrap + decryption, and the relay listener is one
per gateway (``one_per_gateway``), so in-process the whole Marmot pipeline runs on one core.
Threads do not help: base64, JSON and the AEAD hold the GIL (see :mod:`plugins.marmot.service`).
Worker processes do: the event loop keeps the relays, limiters and pushes, and each worker holds
its own copy of the server key (sent once, at start, over the pool's pipe; never to disk).

The functions here run in the workers. They return values instead of raising, because an
exception crossing the process boundary is re-built from its ``args``, which
:class:`~plugins.marmot.errors.Dropped` does not survive. Workers use the wall clock
(``time.time``) for the freshness checks.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from plugins.marmot.errors import ChunkRejected, ChunkResult, Dropped, DropReason
from plugins.marmot.keys import ServerKey
from plugins.marmot.nostr import GiftUnwrapper
from plugins.marmot.tokens import DeviceToken, TokenDecryptor, TokenFormat
from plugins.marmot.trigger import Trigger, TriggerConfig, parse_trigger


@dataclass(frozen=True)
class CryptoSetup:
    """What a worker needs to build its unwrapper and decryptor (picklable)."""

    secret: bytes
    max_event_bytes: int
    max_age: int
    max_future_skew: int
    trigger_config: TriggerConfig

    def __repr__(self) -> str:  # never show the secret
        return "CryptoSetup(...)"


class _Crypto:
    def __init__(self, setup: CryptoSetup) -> None:
        key = ServerKey(setup.secret)
        self.unwrapper = GiftUnwrapper(
            key,
            max_event_bytes=setup.max_event_bytes,
            max_age=setup.max_age,
            max_future_skew=setup.max_future_skew,
            clock=time.time,
        )
        self.decryptor = TokenDecryptor(key)
        self.trigger_config = setup.trigger_config


_crypto: _Crypto | None = None  # this worker process's state, set by the pool initializer


def _init(setup: CryptoSetup) -> None:
    global _crypto
    _crypto = _Crypto(setup)


def _state() -> _Crypto:
    assert _crypto is not None, "not a crypto worker process"
    return _crypto


# -- the two CPU steps, wherever they run ------------------------------------------------------


def open_with(
    unwrapper: GiftUnwrapper,
    trigger_config: TriggerConfig,
    event: Mapping[str, Any],
    verified: list[str],
) -> Trigger:
    """Checks 1-9: unwrap, then profile and content parsing. Raises :class:`Dropped`."""
    rumor = unwrapper.unwrap(event, on_verified=verified.append)
    return parse_trigger(rumor, trigger_config)


def decrypt_with(
    decryptor: TokenDecryptor, chunks: list[bytes], fmt: TokenFormat
) -> list[DeviceToken | ChunkResult]:
    """ECDH, HKDF, AEAD and plaintext checks of each chunk: its token, or why it was rejected."""
    decrypt = decryptor.decrypt_chunk
    out: list[DeviceToken | ChunkResult] = []
    for chunk in chunks:
        try:
            out.append(decrypt(chunk, fmt))
        except ChunkRejected as exc:
            out.append(exc.reason)
    return out


# -- in a worker process ------------------------------------------------------------------------


def ping() -> bool:
    """Answered once the worker has started and built its state."""
    return _state() is not None


def open_trigger(event: dict[str, Any]) -> tuple[list[str], Trigger | DropReason]:
    """`open_with` in a worker: the verified wrap ids, and the trigger or the drop reason."""
    crypto = _state()
    verified: list[str] = []
    try:
        return verified, open_with(crypto.unwrapper, crypto.trigger_config, event, verified)
    except Dropped as exc:
        return verified, exc.reason


def decrypt_chunks(chunks: list[bytes], fmt: TokenFormat) -> list[DeviceToken | ChunkResult]:
    """`decrypt_with` in a worker."""
    return decrypt_with(_state().decryptor, chunks, fmt)


def start_pool(processes: int, setup: CryptoSetup) -> ProcessPoolExecutor:
    """A pool of spawned workers (no fork: the gateway's loop, sockets and threads stay home)."""
    return ProcessPoolExecutor(
        processes,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init,
        initargs=(setup,),
    )
