"""Plain-Python computations of the Spark jobs' numbers, from the receipt files themselves."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gateway.core.classify import CONFIG_REASONS

# Refusals that never retire a token: the guard's hold, an app's configuration refused.
NOT_THE_TOKEN = frozenset({"invalidation_suspended"}) | CONFIG_REASONS

STATUSES = ("ok", "token_invalid", "permanent", "auth", "throttled", "transient")


def load(directory: Path) -> list[dict[str, Any]]:
    """Every record of every `*.jsonl` file under `directory` (all lines must be JSON
    objects; `plausible` tells the ones the jobs use)."""
    records = []
    for path in sorted(directory.rglob("*.jsonl")):
        with path.open(encoding="utf-8") as fh:
            records.extend(json.loads(line) for line in fh)
    return records


REQUIRED = ("v", "ts", "push_id", "plugin", "app_id", "status", "attempts", "latency_ms")


def plausible(r: dict[str, Any]) -> bool:
    """Whether the jobs use a record, by the rules of docs/spark.md ("Input and bad
    lines"), written out here on their own (not the reader's constants)."""
    if any(r.get(name) is None for name in REQUIRED) or r["v"] != 1:
        return False
    status = r.get("http_status")
    return (
        946_684_800 <= r["ts"] < 4_102_444_800  # 2000 to 2099; false for NaN
        and 0 <= r["latency_ms"] <= 30 * 24 * 3600 * 1000
        and 0 <= r["attempts"] <= 2**31 - 1
        and (status is None or 0 <= status <= 999)
    )


def hour(ts: float) -> int:
    return math.floor(ts / 3600) * 3600


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default): rank q*(n-1)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def sent_latencies(rows: Iterable[dict[str, Any]]) -> list[float]:
    """Latencies of the pushes that reached a provider (`attempts >= 1`): the report's
    latency columns leave out pushes refused before sending."""
    return [r["latency_ms"] for r in rows if r["attempts"] >= 1]


def _metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = sent_latencies(rows)
    sent = bool(latencies)  # no push sent: null latency columns
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    return {
        "total": len(rows),
        **counts,
        "other": sum(r["status"] not in STATUSES for r in rows),
        "success_rate": counts["ok"] / len(rows),
        "attempts": sum(r["attempts"] for r in rows),
        "retries": sum(max(r["attempts"] - 1, 0) for r in rows),
        "retried": sum(r["attempts"] > 1 for r in rows),
        "latency_p50": percentile(latencies, 0.5) if sent else None,
        "latency_p95": percentile(latencies, 0.95) if sent else None,
        "latency_p99": percentile(latencies, 0.99) if sent else None,
        "latency_mean": sum(latencies) / len(latencies) if sent else None,
        "latency_max": max(latencies) if sent else None,
    }


def delivery_summary(records: Iterable[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """(hour, plugin, provider, app_id) -> metrics, as `summary` has them."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(hour(r["ts"]), r["plugin"], r["provider"], r["app_id"])].append(r)
    return {key: _metrics(rows) for key, rows in groups.items()}


def delivery_hourly(records: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[hour(r["ts"])].append(r)
    return {key: _metrics(rows) for key, rows in groups.items()}


def reasons(records: Iterable[dict[str, Any]]) -> dict[tuple[Any, ...], int]:
    counts: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in records:
        key = (hour(r["ts"]), r["plugin"], r["provider"], r["app_id"], r["status"], r["reason"])
        counts[key] += 1
    return dict(counts)


def dead_tokens(
    records: Iterable[dict[str, Any]],
    *,
    permanent: tuple[str, ...] = ("token_invalid",),
    transient: tuple[str, ...] = ("transient",),
    n: int = 5,
    window_hours: float = 168.0,
    min_span_hours: float = 24.0,
    now: float | None = None,
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """(plugin, app_id, provider, token_hash) -> {reason, failures, last_seen}."""
    records = list(records)
    # the newest receipt ends the default window, with a token hash or not
    end = now if now is not None else max(r["ts"] for r in records)
    records = [r for r in records if r["token_hash"] is not None]
    cutoff = end - window_hours * 3600
    by_token: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_token[(r["plugin"], r["app_id"], r["provider"], r["token_hash"])].append(r)
    dead = {}
    for key, rows in by_token.items():
        oks = [r["ts"] for r in rows if r["status"] == "ok"]
        last_ok = max(oks) if oks else -math.inf
        # what the mass-invalidation guard held, or an app's configuration refusal, never
        # retires (docs/delivery.md, docs/spark.md)
        perms = [
            r
            for r in rows
            if r["status"] in permanent and r["reason"] not in NOT_THE_TOKEN and r["ts"] > last_ok
        ]
        streak = [
            r["ts"]
            for r in rows
            if r["status"] in transient
            and r["attempts"] > 0
            and r["ts"] > last_ok
            and cutoff <= r["ts"] <= end
        ]
        last_seen = max(r["ts"] for r in rows)
        if perms:
            last = max(perms, key=lambda r: r["ts"])
            reason = last["reason"] if last["reason"] is not None else last["status"]
            dead[key] = {"reason": reason, "failures": len(perms), "last_seen": last_seen}
        elif len(streak) >= n and max(streak) - min(streak) >= min_span_hours * 3600:
            dead[key] = {
                "reason": "consecutive_transient_failures",
                "failures": len(streak),
                "last_seen": last_seen,
            }
    return dead


def volume_anomalies(
    records: Iterable[dict[str, Any]],
    *,
    by: tuple[str, ...] = ("plugin",),
    now: float | None = None,
    factor: float = 3.0,
    baseline_hours: int = 24,
    min_baseline_hours: int = 6,
    min_volume: int = 20,
    min_failures: int = 10,
    min_failure_rate: float = 0.01,
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """(hour, *group, kind) -> numbers; a group is the values of the `by` columns (None
    is a value like any other). An hour ending after `now` (default: the newest receipt)
    is never a `volume_drop`."""
    series = volume_series(records, by=by, now=now, baseline_hours=baseline_hours)
    found = {}
    for (h, *group), row in series.items():
        if row["baseline_hours"] < min_baseline_hours:
            continue
        vol, base = row["volume"], row["baseline_volume"]
        rate, base_rate = row["failure_rate"], row["baseline_failure_rate"]
        floor = max(base_rate or 0.0, min_failure_rate)
        numbers = {"volume": vol, "baseline": base}
        if vol >= min_volume and vol > base * factor:
            found[(h, *group, "volume_spike")] = numbers
        if row["complete"] and base >= min_volume and vol < base / factor:
            found[(h, *group, "volume_drop")] = numbers
        if row["failures"] >= min_failures and rate is not None and rate > floor * factor:
            found[(h, *group, "failure_spike")] = numbers
    return found


def volume_series(
    records: Iterable[dict[str, Any]],
    *,
    by: tuple[str, ...] = ("plugin",),
    now: float | None = None,
    baseline_hours: int = 24,
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """(hour, *group) -> the `volume` table's numbers, for every hour of each group's
    dense series: from the group's first hour to the newest hour in the data (or the last
    one that ended by `now`, when later), a silent
    hour being volume 0 (the series `volume_anomalies` above judges). The baseline of an
    hour is its previous `baseline_hours` hours of that series (fewer near its start)."""
    volume: dict[tuple[Any, ...], int] = defaultdict(int)
    failures: dict[tuple[Any, ...], int] = defaultdict(int)
    records = list(records)
    for r in records:
        key = (tuple(r[c] for c in by), hour(r["ts"]))
        volume[key] += 1
        failures[key] += r["status"] != "ok"
    last = max(h for _, h in volume)
    if now is not None:  # and the silent hours that ended by `now`
        last = max(last, hour(now) - 3600)
    end = now if now is not None else max(r["ts"] for r in records)
    series = {}
    for group in {g for g, _ in volume}:
        first = min(h for g, h in volume if g == group)
        hours = list(range(first, last + 1, 3600))
        vols = [volume.get((group, h), 0) for h in hours]
        fails = [failures.get((group, h), 0) for h in hours]
        for i, h in enumerate(hours):
            prev = range(max(0, i - baseline_hours), i)
            base_vol_sum = sum(vols[j] for j in prev)
            series[(h, *group)] = {
                "volume": vols[i],
                "failures": fails[i],
                "failure_rate": fails[i] / vols[i] if vols[i] else None,
                "baseline_hours": len(prev),
                "baseline_volume": base_vol_sum / len(prev) if prev else None,
                "baseline_failure_rate": (
                    sum(fails[j] for j in prev) / base_vol_sum if base_vol_sum else None
                ),
                "complete": h + 3600 <= end,
            }
    return series
