"""Delivery-core benchmark: the dispatcher against the bare client ceilings.

    .venv/bin/python bench/delivery.py [--n 20000] [--out bench/results/delivery.json]

The simulators run in another process (`python -m gateway.testing.standalone`). In
one run this measures, for APNs and FCM:

- the bare client ceiling: aioapns alone, and a bare aiohttp loop with a cached
  OAuth token, to the same simulators;
- the dispatcher (`Dispatcher.send` with the real provider clients): throughput,
  and its ratio to the ceiling (target >= 80 %);
- latency at half the dispatcher's peak rate, open loop, for the bare client and the
  dispatcher; the difference of their p99 is the latency the core adds (target <= 5 ms);
- RSS with 10,000 pushes in flight (accepted, not final) against simulators that
  answer after 2 s (target <= 200 MB).

This is a benchmark, not a test: it prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import ApnsAppConfig, DeliveryConfig, FcmAppConfig
from gateway.context import TokenHasher
from gateway.core.apns import ApnsClient
from gateway.core.dispatcher import Dispatcher
from gateway.core.fcm import FcmClient
from gateway.core.http import ssl_context
from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken, Push, PushPolicy
from gateway.core.tokens import TokenInvalidation
from gateway.loops import run, tune_gc

CONCURRENCY = 256
ROUNDS = 3  # closed-loop rounds per side, interleaved
APNS_PAYLOAD = {"aps": {"alert": {"title": "New message", "body": "x" * 100}, "badge": 1}}
FCM_PAYLOAD = {
    "data": {"event_id": "$abc", "room_id": "!room:example.org", "unread": "1"},
    "android": {"priority": "high"},
}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def token(n: int) -> str:
    return f"{n:064x}"


class Simulators:
    """The simulators in their own process, as `pushgw simulate` runs them."""

    def __init__(self, delay: float = 0.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pushgw-bench-"))
        self.delay = delay
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def __enter__(self) -> Simulators:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.testing.standalone",
                "--state-dir",
                str(self.dir),
                "--apns-port",
                "0",
                "--fcm-port",
                "0",
                "--delay",
                str(self.delay),
            ],
            stdout=subprocess.DEVNULL,
        )
        ready = self.dir / "ready.json"
        deadline = time.monotonic() + 30
        while not ready.exists():  # another process: its file is the only signal
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("simulators did not start")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)

    def apns_config(self, **overrides: Any) -> ApnsAppConfig:
        i = self.info
        return ApnsAppConfig(
            keyfile=i["local_key_path"],
            key_id=i["local_key_id"],
            team_id=i["local_team_id"],
            topic="com.example.bench",
            host=i["apns_host"],
            port=i["apns_port"],
            ca_file=i["ca_path"],
            **overrides,
        )

    def fcm_config(self, **overrides: Any) -> FcmAppConfig:
        i = self.info
        return FcmAppConfig(
            project_id=i["project_id"],
            service_account_file=i["service_account_path"],
            send_url=i["fcm_send_url_template"],
            **overrides,
        )


async def closed_loop(
    n: int, send: Callable[[int], Awaitable[Any]], concurrency: int = CONCURRENCY
) -> float:
    """Send n requests with `concurrency` outstanding; return requests per second."""
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await send(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - started)


async def open_loop(
    rate: float, seconds: float, send: Callable[[int], Awaitable[Any]]
) -> list[float]:
    """Start requests at a fixed rate (independent of answers); return latencies in ms."""
    latencies: list[float] = []
    # Only the running requests are kept: a load generator holding every finished task
    # (and its result) would grow the heap and time its own garbage collection.
    running: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        await send(i)
        latencies.append((time.perf_counter() - t0) * 1000)

    total = int(rate * seconds)
    start = time.perf_counter()
    for i in range(total):
        target = start + i / rate
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# --- bare clients -----------------------------------------------------------------


async def bare_aioapns(
    sims: Simulators,
) -> tuple[Callable[[int], Awaitable[Any]], Callable[[], Awaitable[None]]]:
    from aioapns import APNs, NotificationRequest
    from aioapns.connection import APNsTLSClientProtocol

    i = sims.info
    client = APNs(
        key=Path(i["local_key_path"]).read_text(),
        key_id=i["local_key_id"],
        team_id=i["local_team_id"],
        topic="com.example.bench",
        ssl_context=ssl_context(Path(i["ca_path"]), alpn=["h2"]),
        max_connection_attempts=1,
    )

    class Protocol(APNsTLSClientProtocol):  # providers.md §4.1: no base-URL option
        APNS_SERVER = i["apns_host"]
        APNS_PORT = i["apns_port"]
        INACTIVITY_TIME = 3600

    client.pool.protocol_class = Protocol
    client.pool.max_connections = 4

    async def send(n: int) -> None:
        result = await client.send_notification(
            NotificationRequest(device_token=token(n), message=APNS_PAYLOAD)
        )
        assert result.is_successful, result.description

    async def close() -> None:
        client.pool.close()

    return send, close


async def bare_aiohttp_fcm(
    sims: Simulators,
) -> tuple[Callable[[int], Awaitable[Any]], Callable[[], Awaitable[None]]]:
    i = sims.info
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    # one OAuth token through the real client (firebase-admin credentials), then a bare loop
    probe = FcmClient("probe", sims.fcm_config())
    await probe.start()
    await probe.refresh_credentials()
    assert probe._headers is not None
    bearer = probe._headers["Authorization"]  # the cached token, as the real client holds it
    await probe.close()
    url = i["fcm_send_url_template"].format(project_id=i["project_id"])
    headers = {"Authorization": bearer, "Content-Type": "application/json"}

    async def send(n: int) -> None:
        body = json.dumps({"message": {**FCM_PAYLOAD, "token": f"fcm-{n}"}}, separators=(",", ":"))
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            assert response.status == 200

    return send, session.close


# --- the dispatcher -----------------------------------------------------------------


async def dispatcher_for(
    sims: Simulators, apns: dict[str, Any] | None = None, fcm: dict[str, Any] | None = None
) -> Dispatcher:
    metrics = Metrics()

    async def notify(_: InvalidToken) -> None:
        return None

    dispatcher = Dispatcher(
        DeliveryConfig(),
        metrics,
        TokenInvalidation(None, metrics, notify),
        TokenHasher(b"bench"),
        None,
    )
    dispatcher.add_app("bench", "ios", ApnsClient("ios", sims.apns_config(**(apns or {}))))
    dispatcher.add_app("bench", "android", FcmClient("android", sims.fcm_config(**(fcm or {}))))
    await dispatcher.start()
    return dispatcher


def dispatcher_sender(dispatcher: Dispatcher, app: str) -> Callable[[int], Awaitable[Any]]:
    payload = APNS_PAYLOAD if app == "ios" else FCM_PAYLOAD
    policy = PushPolicy(deadline=30.0)

    async def send(n: int) -> None:
        receipt = await dispatcher.send(Push("bench", app, token(n), payload, policy=policy))
        assert receipt.ok, (receipt.outcome, receipt.reason)

    return send


async def measure(n: int, loop: str) -> dict[str, Any]:
    results: dict[str, Any] = {
        "cores": os.cpu_count(),
        "n": n,
        "python": sys.version.split()[0],
        "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
    }
    with Simulators() as sims:
        for provider, bare_factory, app in (
            ("apns", bare_aioapns, "ios"),
            ("fcm", bare_aiohttp_fcm, "android"),
        ):
            bare_send, bare_close = await bare_factory(sims)
            limits = {"max_in_flight": CONCURRENCY * 2}
            dispatcher = await dispatcher_for(sims, limits, {**limits, "max_connections": 64})
            send = dispatcher_sender(dispatcher, app)
            tune_gc()  # as the gateway does after start-up
            for warm in (bare_send, send):  # connections open, caches warm
                await closed_loop(min(2000, n), warm)
            # Interleaved rounds, best of each: drift in what else the host runs hits
            # both sides alike instead of whichever happened to run second.
            ceilings, peaks, bare_cpu, core_cpu = [], [], 0.0, 0.0
            for _ in range(ROUNDS):
                c0 = cpu_seconds()
                ceilings.append(await closed_loop(n, bare_send))
                c1 = cpu_seconds()
                peaks.append(await closed_loop(n, send))
                bare_cpu += c1 - c0
                core_cpu += cpu_seconds() - c1
            ceiling, peak = max(ceilings), max(peaks)
            bare_cpu_us = bare_cpu / (ROUNDS * n) * 1e6
            core_cpu_us = core_cpu / (ROUNDS * n) * 1e6

            rate = peak / 2
            bare_lat = await open_loop(rate, 5.0, bare_send)
            core_lat = await open_loop(rate, 5.0, send)
            await dispatcher.close()
            await bare_close()
            results[provider] = {
                "bare_ceiling_per_s": round(ceiling),
                "dispatcher_per_s": round(peak),
                "ratio": round(peak / ceiling, 3),
                "bare_rounds_per_s": [round(r) for r in ceilings],
                "dispatcher_rounds_per_s": [round(r) for r in peaks],
                "bare_cpu_us_per_push": round(bare_cpu_us, 1),
                "dispatcher_cpu_us_per_push": round(core_cpu_us, 1),
                "half_peak_rate_per_s": round(rate),
                "bare_p50_ms": round(pct(bare_lat, 50), 2),
                "bare_p99_ms": round(pct(bare_lat, 99), 2),
                "dispatcher_p50_ms": round(pct(core_lat, 50), 2),
                "dispatcher_p99_ms": round(pct(core_lat, 99), 2),
                "added_p99_ms": round(pct(core_lat, 99) - pct(bare_lat, 99), 2),
                "added_mean_ms": round(statistics.mean(core_lat) - statistics.mean(bare_lat), 2),
            }
    with Simulators(delay=2.0) as slow:
        base = rss_mb()
        dispatcher = await dispatcher_for(
            slow,
            {"max_in_flight": 10_000, "max_connections": 8},
            {"max_in_flight": 10_000, "max_connections": 512},
        )
        tasks = [
            dispatcher.submit(
                Push(
                    "bench",
                    "ios" if i % 2 else "android",
                    token(i),
                    APNS_PAYLOAD if i % 2 else FCM_PAYLOAD,
                    policy=PushPolicy(deadline=60.0),
                )
            )
            for i in range(10_000)
        ]
        while dispatcher.in_flight < 10_000:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # let connections and streams open
        peak_rss = rss_mb()
        in_flight = dispatcher.in_flight
        receipts = await asyncio.gather(*tasks)
        await dispatcher.close()
        results["in_flight"] = {
            "pushes_in_flight": in_flight,
            "rss_mb_before": round(base, 1),
            "rss_mb_with_10k_in_flight": round(peak_rss, 1),
            "delivered_ok": sum(r.ok for r in receipts),
        }
    return results


def table(results: dict[str, Any]) -> str:
    rows = [
        f"delivery benchmark: {results['cores']} cores, n={results['n']}, "
        f"Python {results['python']}, {results['loop']} loop",
        "",
    ]
    rows.append(f"{'':24}{'APNs':>12}{'FCM':>12}")
    keys = [
        "bare_ceiling_per_s",
        "dispatcher_per_s",
        "ratio",
        "bare_cpu_us_per_push",
        "dispatcher_cpu_us_per_push",
        "half_peak_rate_per_s",
        "bare_p50_ms",
        "bare_p99_ms",
        "dispatcher_p50_ms",
        "dispatcher_p99_ms",
        "added_p99_ms",
        "added_mean_ms",
    ]
    for key in keys:
        rows.append(f"{key:24}{results['apns'][key]:>12}{results['fcm'][key]:>12}")
    rows.append("")
    for key, value in results["in_flight"].items():
        rows.append(f"{key:28}{value:>10}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--out", default="bench/results/delivery.json")
    parser.add_argument(
        "--loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="event loop, as server.event_loop (default: what `pushgw serve` runs on)",
    )
    args = parser.parse_args()
    results = run(measure(args.n, args.loop), args.loop)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
