"""Synthetic delivery receipts for tests, demos and the benchmark.

`receipts()` yields real `gateway.core.push.Receipt` objects (varied plugins, apps,
providers, outcomes, reasons, retries, latencies and times). Tests write them with the
gateway's own `ReceiptWriter` (`write_with_receipt_writer`); the benchmark writes
millions with `write_jsonl_fast`, which serialises each receipt with the writer's own
`receipt_record()` and the writer's JSON settings, from a process pool, into files
named and rolled like the writer's. Each worker stands for one gateway node: its
receipts are in time order, so, as with a real writer, a file covers a stretch of time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gateway.core.push import Outcome, ProviderKind, Receipt
from gateway.core.receipts import ReceiptsFormat, ReceiptWriter, receipt_record

# plugin -> [(app_id, provider)]; Marmot's policy forbids a token hash in its receipts.
APPS: dict[str, list[tuple[str, ProviderKind | None]]] = {
    "matrix": [
        ("im.vector.app.ios", ProviderKind.APNS),
        ("im.vector.app.android", ProviderKind.FCM),
    ],
    "zulip": [("com.zulip.flutter", ProviderKind.APNS), ("zulip-android", ProviderKind.FCM)],
    "status": [("im.status.ethereum", ProviderKind.FCM)],
    "simplex": [("chat.simplex.app", ProviderKind.APNS)],
    "marmot": [("marmot.ios", ProviderKind.APNS), ("marmot.android", ProviderKind.FCM)],
}
NO_HASH = {"marmot"}

# (outcome, weight, http status, reasons by provider)
_OUTCOMES: list[tuple[Outcome, float, int | None, dict[str, list[str]]]] = [
    (Outcome.OK, 0.90, 200, {"apns": [""], "fcm": [""]}),
    (
        Outcome.TRANSIENT,
        0.03,
        503,
        {
            "apns": ["ServiceUnavailable", "timeout", "connection_error"],
            "fcm": ["UNAVAILABLE", "INTERNAL", "timeout"],
        },
    ),
    (Outcome.THROTTLED, 0.01, 429, {"apns": ["TooManyRequests"], "fcm": ["QUOTA_EXCEEDED"]}),
    (
        Outcome.TOKEN_INVALID,
        0.03,
        410,
        {"apns": ["Unregistered", "BadDeviceToken"], "fcm": ["UNREGISTERED"]},
    ),
    (
        Outcome.PERMANENT,
        0.02,
        400,
        {
            "apns": ["BadTopic", "payload_too_large"],
            "fcm": ["INVALID_ARGUMENT", "payload_too_large"],
        },
    ),
    (Outcome.AUTH, 0.01, 403, {"apns": ["ExpiredProviderToken"], "fcm": ["UNAUTHENTICATED"]}),
]


def token_hash(token: str) -> str:
    """A stand-in for the gateway's keyed hash (any 64-hex value will do for analytics)."""
    return hashlib.sha256(token.encode()).hexdigest()


def receipts(
    n: int,
    *,
    seed: int = 1,
    start: float = 1_735_689_600.0,  # 2025-01-01T00:00:00Z
    hours: int = 48,
    tokens: int = 2_000,
    in_time_order: bool = False,
) -> Iterator[Receipt]:
    """`n` receipts spread uniformly over `hours` hours from `start`, reproducibly.

    With `in_time_order` their finish times increase, as in the files of one gateway
    node (its writer appends each receipt when the push finishes); otherwise every
    receipt may fall anywhere in the window.
    """
    rng = random.Random(seed)
    span = hours * 3600
    plugins = list(APPS)
    weights = [o[1] for o in _OUTCOMES]
    for i in range(n):
        plugin = rng.choice(plugins)
        app_id, provider = rng.choice(APPS[plugin])
        outcome, _, http, reasons = rng.choices(_OUTCOMES, weights)[0]
        kind = provider.value if provider else "apns"
        reason: str | None = rng.choice(reasons[kind]) or None
        attempts = 1
        if outcome is Outcome.OK:
            attempts = 1 if rng.random() < 0.95 else rng.randint(2, 4)
        elif outcome.retryable:
            attempts = rng.randint(1, 4)
        status: int | None = http
        if reason == "payload_too_large":
            attempts, status = 0, None
        latency = rng.lognormvariate(-3.5, 0.8) * attempts if attempts else rng.random() * 1e-3
        if rng.random() < 0.002:  # a push for an app the gateway does not know
            provider, outcome, status, reason, attempts = (
                None,
                Outcome.PERMANENT,
                None,
                "unknown_app",
                0,
            )
        token = f"{plugin}-token-{rng.randrange(tokens)}"
        push_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        offset = (i + rng.random()) * span / n if in_time_order else rng.random() * span
        yield Receipt(
            push_id=push_id,
            plugin=plugin,
            app_id=app_id,
            provider=provider,
            outcome=outcome,
            status=status,
            reason=reason,
            attempts=attempts,
            latency=latency,
            finished_at=start + offset,
            token_hash=None if plugin in NO_HASH else token_hash(token),
        )


async def _write_async(
    items: list[Receipt], directory: Path, roll_bytes: int, file_format: ReceiptsFormat
) -> None:
    writer = ReceiptWriter(directory, roll_bytes=roll_bytes, buffer=10_000, file_format=file_format)
    await writer.start()
    for receipt in items:
        await writer.put(receipt)
    await writer.close()  # writes everything accepted, renames the last file


def write_with_receipt_writer(
    items: list[Receipt],
    directory: Path,
    *,
    roll_bytes: int = 256 * 1024,
    file_format: ReceiptsFormat = "jsonl",
) -> None:
    """Write `items` with the gateway's real `ReceiptWriter` (files rolled by size)."""
    asyncio.run(_write_async(items, directory, roll_bytes, file_format))


def _fast_chunk(args: tuple[int, int, int, str, int, float, int, int]) -> int:
    n, seed, worker, directory, per_file, start, hours, tokens = args
    lines = 0
    seq = 0
    out = None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    receipts_of_node = receipts(
        n, seed=seed, start=start, hours=hours, tokens=tokens, in_time_order=True
    )
    for receipt in receipts_of_node:
        if out is None or lines % per_file == 0:
            if out is not None:
                out.close()
            seq += 1
            name = f"receipts-{stamp}-{worker}-{seq:04d}.jsonl"
            out = open(os.path.join(directory, name), "w", encoding="utf-8")  # noqa: SIM115
        out.write(json.dumps(receipt_record(receipt), separators=(",", ":")) + "\n")
        lines += 1
    if out is not None:
        out.close()
    return lines


# Device tokens per plugin and process of `write_jsonl_fast`: 1.2M tokens in 10M receipts.
FAST_TOKENS = 200_000


def write_jsonl_fast(
    n: int,
    directory: Path,
    *,
    workers: int | None = None,
    per_file: int = 230_000,  # about 64 MiB, the writer's default roll size
    seed: int = 7,
    start: float = 1_735_689_600.0,
    hours: int = 24 * 14,
    tokens: int = FAST_TOKENS,
) -> int:
    """Write `n` receipts as JSON Lines from a process pool (benchmark fast path).

    `tokens` is the number of device tokens per plugin and worker.
    """
    directory.mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    chunks = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    jobs = [
        (c, seed * 1000 + i, i, str(directory), per_file, start, hours, tokens)
        for i, c in enumerate(chunks)
    ]
    with ProcessPoolExecutor(workers) as pool:
        return sum(pool.map(_fast_chunk, jobs))
