"""Property-based review of the Spark jobs' numbers (seat: the correctness auditor).

Hypothesis generates adversarial receipt sets: receipts on hour boundaries and a
microsecond either side, equal `ts`, a token that fails, succeeds and fails again,
failures on the window's edge, statuses this version does not know, `attempts` 0,
latency groups of 1, 2 and exactly k values or all equal, silent hours inside a
baseline, several plugins and apps sharing one token hash. They are written with the
gateway's own `ReceiptWriter`, each job runs as `pushgw spark run` runs it (options
parsed from text and checked), and every output column is compared with a plain-Python
computation written from docs/spark.md, not from the jobs' code (nor from
`reference.py`).

Spark is slow: few examples per test, derandomized (the same ones every run, so a
failure is reproducible), each packing many independent cases (tokens, groups, hours)
into one run, plus `@example`s for the edges named in the review.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.core.classify import CONFIG_REASONS
from gateway.core.push import Outcome, ProviderKind, Receipt
from gateway.receipt_files import read_records
from spark_plugins import synthetic
from spark_plugins.dead_tokens import JOB as DEAD_TOKENS
from spark_plugins.delivery_report import JOB as REPORT
from spark_plugins.jobs import JobResult, SparkJob
from spark_plugins.volume_anomalies import JOB as ANOMALIES
from tests.spark.conftest import START

# Refusals that never retire a token (docs/spark.md): the guard's hold, a configuration one.
NOT_THE_TOKEN = frozenset({"invalidation_suspended"}) | CONFIG_REASONS

pytestmark = pytest.mark.spark

H = 3600
KNOWN = ("ok", "token_invalid", "permanent", "auth", "throttled", "transient")
UNKNOWN = "expired"  # a status a newer gateway might write: `other` in the report

SLOW = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

_cases = itertools.count()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("properties")


def _receipt(
    ts: float,
    status: str,
    *,
    token: str | None,
    plugin: str = "matrix",
    app_id: str = "app.a",
    provider: str | None = "apns",
    reason: str | None = None,
    attempts: int = 1,
    latency_ms: float = 5.0,
) -> Receipt:
    """A receipt as the dispatcher makes one; an unknown status through a stand-in
    outcome (the writer only reads its `.value`)."""
    outcome = Outcome(status) if status in KNOWN else cast(Outcome, SimpleNamespace(value=status))
    return Receipt(
        push_id=f"push-{next(_cases)}",
        plugin=plugin,
        app_id=app_id,
        provider=ProviderKind(provider) if provider else None,
        outcome=outcome,
        status=200 if status == "ok" else (None if attempts == 0 else 503),
        reason=reason,
        attempts=attempts,
        latency=latency_ms / 1000,
        finished_at=ts,
        token_hash=None if token is None else synthetic.token_hash(token),
    )


def _run(
    spark: Any,
    job: SparkJob,
    items: list[Receipt],
    options: list[str],
    workdir: Path,
    *,
    file_format: str = "jsonl",
) -> tuple[Path, JobResult, list[dict[str, Any]]]:
    """Write `items` with the gateway's writer, run `job` over them with `options` as
    given on the command line; returns --out, the result and the records on disk."""
    case = workdir / f"case-{next(_cases)}"
    receipts, out = case / "receipts", case / "out"
    receipts.mkdir(parents=True)
    if items:
        synthetic.write_with_receipt_writer(
            items,
            receipts,
            file_format="parquet" if file_format == "parquet" else "jsonl",
        )
    result = job.run(spark, str(receipts), str(out), job.resolve_options(options))
    assert result.input.bad == 0
    return out, result, read_records(receipts)


def _parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return cast(list[dict[str, Any]], pq.read_table(str(path)).to_pylist())


def _stamp(value: Any) -> int:
    """A table's `hour` (a UTC instant) as unix seconds."""
    return int(value.timestamp())


def _hour(ts: float) -> int:
    """Start of the UTC hour of `ts`, exactly (no float division)."""
    return math.floor(Fraction(ts) / H) * H


def _close(got: float | None, want: float | None) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)


# --------------------------------------------------------------------------- dead-tokens

REASONS = {  # what each status's reason may be, as the gateway writes them
    "ok": [None],
    "token_invalid": ["BadDeviceToken", "Unregistered", None],
    "permanent": ["BadTopic", "invalidation_suspended", None],
    "transient": ["timeout", "UNAVAILABLE", "queue_full"],
    "auth": ["ExpiredProviderToken"],
    "throttled": ["TooManyRequests"],
}

# (half-hour slot, status, attempts, reason pick): slots collide often (equal `ts`)
EVENT = st.tuples(
    st.integers(0, 16), st.sampled_from(KNOWN), st.sampled_from([0, 1, 2]), st.integers(0, 2)
)
TOKEN = st.tuples(  # few names: one token hash under several plugins and apps
    st.sampled_from(["matrix", "zulip"]),
    st.sampled_from(["app.a", "app.b"]),
    st.sampled_from(["apns", "fcm"]),
    st.sampled_from(["t0", "t1", "t2"]),
)
HISTORIES = st.dictionaries(TOKEN, st.lists(EVENT, min_size=1, max_size=9), max_size=14)


def _history(key: tuple[str, str, str, str], events: list[tuple[int, str, int, int]]) -> list[Any]:
    plugin, app_id, provider, token = key
    items = []
    for slot, status, attempts, pick in events:
        choices = REASONS[status]
        reason = choices[pick % len(choices)]
        items.append(
            _receipt(
                START + slot * 1800,
                status,
                token=token,
                plugin=plugin,
                app_id=app_id,
                provider=provider,
                reason=reason,
                attempts=attempts,
            )
        )
    return items


def expected_dead_tokens(
    records: list[dict[str, Any]],
    *,
    permanent: tuple[str, ...],
    transient: tuple[str, ...],
    n: int,
    window_hours: float,
    min_span_hours: float,
    now: float | None,
) -> tuple[dict[tuple[Any, ...], dict[str, Any]], float | None]:
    """docs/spark.md, `dead-tokens`: key -> {reasons (any one of them), failures,
    last_seen}, and the window's end (None: the wall clock, no receipt)."""
    newest = max((r["ts"] for r in records), default=None)  # "the newest receipt"
    end = now if now is not None else newest  # (the receipts are older than the clock)
    tokens: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["token_hash"] is not None:  # never considered otherwise
            tokens[(r["plugin"], r["app_id"], r["provider"], r["token_hash"])].append(r)
    dead = {}
    for key, rows in tokens.items():
        # an `ok` revives, whenever it came; at the same `ts` as a failure it wins
        revived = max((r["ts"] for r in rows if r["status"] == "ok"), default=-math.inf)
        perms = [
            r
            for r in rows
            if r["status"] in permanent
            and not (r["status"] == "permanent" and r["reason"] in NOT_THE_TOKEN)
            and r["ts"] > revived
        ]
        last_seen = max(r["ts"] for r in rows)
        if perms:
            last = max(r["ts"] for r in perms)
            reasons = {r["reason"] or r["status"] for r in perms if r["ts"] == last}
            dead[key] = {"reasons": reasons, "failures": len(perms), "last_seen": last_seen}
            continue
        assert end is not None
        streak = [
            r["ts"]
            for r in rows
            if r["status"] in transient
            and r["attempts"] > 0
            and r["ts"] > revived
            and end - window_hours * H <= r["ts"] <= end
        ]
        if len(streak) >= n and max(streak) - min(streak) >= min_span_hours * H:
            dead[key] = {
                "reasons": {"consecutive_transient_failures"},
                "failures": len(streak),
                "last_seen": last_seen,
            }
    return dead, end


DEAD_OPTIONS = st.fixed_dictionaries(
    {
        "permanent_statuses": st.sampled_from(["token_invalid", "token_invalid,permanent", ""]),
        "transient_statuses": st.sampled_from(["transient", "transient,throttled"]),
        "transient_failures": st.sampled_from([1, 2, 3]),
        "window_hours": st.sampled_from([0.5, 1.0, 2.5, 168.0]),
        "min_span_hours": st.sampled_from([0.0, 0.5, 1.0]),
        "now": st.one_of(
            st.none(),
            st.builds(
                lambda slot, nudge: START + slot * 1800 + nudge,
                st.integers(0, 20),
                st.sampled_from([0.0, -0.000001, 0.000001]),
            ),
        ),
    }
).map(lambda o: {**o, "min_span_hours": min(o["min_span_hours"], o["window_hours"])})
# a receipt without a token hash (Marmot's policy), maybe the newest of all
UNHASHED = st.one_of(st.none(), st.integers(0, 24))


def _dead_example(
    histories: dict[tuple[str, str, str, str], list[tuple[int, str, int, int]]],
    unhashed: int | None,
    opts: dict[str, Any],
) -> Any:
    return example(histories=histories, unhashed=unhashed, opts=opts)


DEFAULTS = {
    "permanent_statuses": "token_invalid",
    "transient_statuses": "transient",
    "transient_failures": 2,
    "window_hours": 2.5,
    "min_span_hours": 1.0,
    "now": None,
}
T = ("matrix", "app.a", "apns", "t0")


@settings(SLOW, max_examples=4)  # several Spark actions per run: the slowest job here
@given(histories=HISTORIES, unhashed=UNHASHED, opts=DEAD_OPTIONS)
# fails, succeeds, fails again (the streak restarts); ties of ok and failure
@_dead_example(
    {
        T: [
            (0, "transient", 1, 0),
            (2, "transient", 1, 0),
            (3, "ok", 1, 0),
            (3, "transient", 1, 0),
            (5, "transient", 1, 0),
            (8, "transient", 1, 0),
        ],
        ("zulip", "app.a", "apns", "t0"): [(1, "ok", 1, 0), (4, "token_invalid", 1, 0)],
        ("matrix", "app.b", "apns", "t0"): [(4, "token_invalid", 1, 0), (4, "ok", 1, 0)],
        ("matrix", "app.a", "fcm", "t0"): [(2, "permanent", 1, 1), (6, "permanent", 1, 0)],
    },
    None,
    {**DEFAULTS, "permanent_statuses": "token_invalid,permanent"},
)
# failures straddling the window's edge: the oldest exactly on it; a Marmot receipt
# (no token hash) is the newest receipt, which ends the window
@_dead_example(
    {
        T: [(6, "transient", 1, 0), (8, "transient", 2, 1), (11, "transient", 1, 0)],
        ("matrix", "app.a", "apns", "t1"): [(5, "transient", 1, 0), (11, "transient", 1, 0)],
    },
    11,
    {**DEFAULTS, "window_hours": 2.5, "min_span_hours": 0.0},
)
@_dead_example(
    {
        T: [(6, "transient", 1, 0), (8, "transient", 2, 1), (11, "transient", 1, 0)],
        ("matrix", "app.a", "apns", "t1"): [(5, "transient", 1, 0), (9, "transient", 1, 0)],
    },
    14,
    {**DEFAULTS, "window_hours": 2.5, "min_span_hours": 0.0},
)
def test_dead_tokens_match_the_documented_rules(
    spark: Any,
    workdir: Path,
    histories: dict[tuple[str, str, str, str], list[tuple[int, str, int, int]]],
    unhashed: int | None,
    opts: dict[str, Any],
) -> None:
    items = [r for key, events in histories.items() for r in _history(key, events)]
    if unhashed is not None:
        items.append(
            _receipt(START + unhashed * 1800, "ok", token=None, plugin="marmot", app_id="m")
        )
    options = [f"{k}={v}" for k, v in opts.items() if v is not None]
    out, result, records = _run(spark, DEAD_TOKENS, items, options, workdir)

    lines = (out / "dead-tokens.jsonl").read_text(encoding="utf-8").splitlines()
    entries = [json.loads(line) for line in lines]
    want, end = expected_dead_tokens(
        records,
        permanent=tuple(s for s in opts["permanent_statuses"].split(",") if s),
        transient=tuple(opts["transient_statuses"].split(",")),
        n=opts["transient_failures"],
        window_hours=opts["window_hours"],
        min_span_hours=opts["min_span_hours"],
        now=opts["now"],
    )
    for entry in entries:
        assert list(entry) == [
            "plugin",
            "app_id",
            "provider",
            "token_hash",
            "reason",
            "failures",
            "last_seen",
        ]
    order = [(e["plugin"], e["app_id"], e["token_hash"]) for e in entries]
    assert order == sorted(order)
    got = {(e["plugin"], e["app_id"], e["provider"], e["token_hash"]): e for e in entries}
    assert len(got) == len(entries)
    assert set(got) == set(want)
    for key, w in want.items():
        assert got[key]["reason"] in w["reasons"], key
        assert got[key]["failures"] == w["failures"], key
        assert got[key]["last_seen"] == pytest.approx(w["last_seen"], abs=1e-6), key
    metrics = result.metrics
    if end is not None:
        assert metrics["window_end"] == pytest.approx(end, abs=1e-6)
    hashed = {(r["plugin"], r["app_id"], r["provider"], r["token_hash"]) for r in records}
    assert metrics["tokens_seen"] == len({k for k in hashed if k[3] is not None})
    assert metrics["tokens_retired"] == len(entries)
    assert metrics["tokens_not_retirable"] == 0
    by_reason: dict[str, int] = defaultdict(int)
    for e in entries:
        by_reason[e["reason"]] += 1
    assert metrics["by_reason"] == by_reason


def test_dead_tokens_window_ends_at_the_newest_receipt_even_one_without_a_hash(
    spark: Any, workdir: Path
) -> None:
    """`now` defaults to the newest receipt: a Marmot receipt (no token hash) is one.
    The window used to end at the newest hashed receipt instead, 5 hours earlier here,
    and reached back to failures more than `window_hours` before the data's end."""
    items = [_receipt(START + h * H, "transient", token="t", reason="timeout") for h in (0, 6, 12)]
    items.append(_receipt(START + 17 * H, "ok", token=None, plugin="marmot", app_id="m"))
    options = ["transient_failures=3", "window_hours=14", "min_span_hours=1"]
    out, result, _ = _run(spark, DEAD_TOKENS, items, options, workdir)
    assert result.metrics["window_end"] == START + 17 * H
    assert result.metrics["tokens_seen"] == 1
    # the failure at hour 0 lies 17 hours before the end: two in the window, not three
    assert (out / "dead-tokens.jsonl").read_text() == ""


NOT_JSON = "receipts-20250101T000000Z-1-0001.jsonl"


@pytest.mark.parametrize("job", [REPORT, DEAD_TOKENS, ANOMALIES], ids=lambda j: j.name)
def test_a_directory_of_bad_lines_only_reports_them(
    spark: Any, workdir: Path, job: SparkJob
) -> None:
    """Every line bad (a gateway writing milliseconds, say): the job must say so. Adaptive
    execution swapped the plan for an empty one when its shuffle came out empty, and the
    counts observed on the read went with it: "0 receipts, 0 bad lines"."""
    receipts = workdir / f"case-{next(_cases)}"
    receipts.mkdir()
    (receipts / NOT_JSON).write_text('not json\n{"v": 1, "ts": 1735689600000}\n')
    options = job.resolve_options(["chart=false"] if job is REPORT else [])
    result = job.run(spark, str(receipts), str(receipts.with_suffix(".out")), options)
    assert (result.input.records, result.input.bad) == (0, 2)
    assert [(b.line, b.text[:8]) for b in result.input.bad_lines] == [
        (1, "not json"),
        (2, '{"v": 1,'),
    ]


def test_dead_tokens_count_the_receipts_read_when_none_has_a_token_hash(
    spark: Any, workdir: Path
) -> None:
    """Only Marmot receipts (no token hash) and a bad line: no token, but the receipt was
    read and the bad line is reported, as the other jobs report them."""
    items = [_receipt(START + i, "ok", token=None, plugin="marmot", app_id="m") for i in range(3)]
    case = workdir / f"case-{next(_cases)}"
    synthetic.write_with_receipt_writer(items, case)
    (case / NOT_JSON).write_text("not json\n")
    options = DEAD_TOKENS.resolve_options([])
    result = DEAD_TOKENS.run(spark, str(case), str(case.with_suffix(".out")), options)
    assert (result.input.records, result.input.bad) == (3, 1)
    assert result.metrics["window_end"] == START + 2
    assert result.metrics["tokens_seen"] == 0


# ----------------------------------------------------------------------- delivery-report

GROUPS = [  # (plugin, app_id, provider); a push for an unknown app has no provider
    ("matrix", "app.a", "apns"),
    ("matrix", "app.b", "fcm"),
    ("zulip", "app.a", "apns"),
    ("zulip", "unknown", None),
]
# on the hour, a microsecond after it, half past, a microsecond before the next
OFFSETS = [0.0, 0.000001, 1800.0, 3599.999999]
LATENCIES = [0.0, 1.0, 1.0, 7.25, 250.0, 3000.5]
PUSH = st.tuples(
    st.integers(0, len(GROUPS) - 1),
    st.integers(0, 2),  # hour
    st.integers(0, len(OFFSETS) - 1),
    st.sampled_from([*KNOWN, UNKNOWN]),
    st.sampled_from([0, 1, 1, 2, 5]),  # attempts
    st.integers(0, len(LATENCIES) - 1),
)
# a block of sent pushes in one group and hour: 1, 2, exactly k (8) or k + 1 values,
# maybe all equal
BLOCK = st.tuples(
    st.integers(0, len(GROUPS) - 1),
    st.integers(0, 2),
    st.sampled_from([1, 2, 8, 9]),
    st.booleans(),
)
REPORT_MODE = st.sampled_from(["exact", "sketch_k=8", "sketch_k=1000"])


def _pushes(
    pushes: list[tuple[int, int, int, str, int, int]], blocks: list[tuple[int, int, int, bool]]
) -> list[Receipt]:
    items = []
    for g, hour, offset, status, attempts, lat in pushes:
        plugin, app_id, provider = GROUPS[g]
        items.append(
            _receipt(
                START + hour * H + OFFSETS[offset],
                status,
                token="t",
                plugin=plugin,
                app_id=app_id,
                provider=provider,
                reason=None if status == "ok" else f"why-{lat % 2}",
                attempts=attempts,
                latency_ms=LATENCIES[lat],
            )
        )
    for g, hour, size, equal in blocks:
        plugin, app_id, provider = GROUPS[g]
        items += [
            _receipt(
                START + hour * H + 60 * i,
                "ok",
                token="t",
                plugin=plugin,
                app_id=app_id,
                provider=provider,
                latency_ms=42.0 if equal else 10.0 * (size - i),
            )
            for i in range(size)
        ]
    return items


def _nearest_rank(values: list[float], q: str) -> float:
    """The smallest value whose rank (1-based) reaches q*n."""
    ordered = sorted(values)
    rank = max(1, math.ceil(Fraction(q) * len(ordered)))
    return ordered[rank - 1]


def _interpolated(values: list[float], q: str) -> float:
    """Linear interpolation between the closest ranks: 0-based rank q*(n-1)."""
    ordered = sorted(values)
    pos = Fraction(q) * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * float(pos - lo)


def expected_report_row(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """docs/spark.md, `delivery-report`: one summary (or hourly) row's numbers; a
    percentile the doc does not pin (a sketch holding more than k values) is a set of
    the values it may take."""
    sent = [r["latency_ms"] for r in rows if r["attempts"] >= 1]
    counts = {s: sum(r["status"] == s for r in rows) for s in KNOWN}
    want: dict[str, Any] = {
        "total": len(rows),
        **counts,
        "other": sum(r["status"] not in KNOWN for r in rows),
        "success_rate": counts["ok"] / len(rows),
        "attempts": sum(r["attempts"] for r in rows),
        "retries": sum(r["attempts"] - 1 for r in rows if r["attempts"] >= 1),
        "retried": sum(r["attempts"] > 1 for r in rows),
        "latency_mean": sum(sent) / len(sent) if sent else None,
        "latency_max": max(sent) if sent else None,
    }
    k = 1000 if mode == "sketch_k=1000" else 8
    for q in ("0.5", "0.95", "0.99"):
        column = f"latency_p{q[2:].ljust(2, '0')}"
        if not sent:
            want[column] = None
        elif mode == "exact":
            want[column] = _interpolated(sent, q)
        elif len(sent) <= k:  # a sketch of at most k values is exact: nearest rank
            want[column] = _nearest_rank(sent, q)
        else:
            want[column] = set(sent)
    return want


SUMMARY_COLUMNS = [
    "hour",
    "plugin",
    "provider",
    "app_id",
    "total",
    *KNOWN,
    "other",
    "success_rate",
    "attempts",
    "retries",
    "retried",
    "latency_p50",
    "latency_p95",
    "latency_p99",
    "latency_mean",
    "latency_max",
]


def _check_row(got: dict[str, Any], want: dict[str, Any], where: Any) -> None:
    for column, value in want.items():
        if isinstance(value, set):
            assert got[column] in value, (where, column)
        elif isinstance(value, float) or isinstance(got[column], float):
            assert _close(got[column], value), (where, column, got[column], value)
        else:
            assert got[column] == value, (where, column)


@SLOW
@given(
    pushes=st.lists(PUSH, max_size=40),
    blocks=st.lists(BLOCK, max_size=4),
    mode=REPORT_MODE,
    parquet=st.booleans(),
)
# groups of 1, 2 and exactly k sent pushes, all equal or not, and one of only refusals
@example(
    pushes=[(3, 1, 0, "permanent", 0, 0), (3, 1, 3, UNKNOWN, 0, 3)],
    blocks=[(0, 0, 1, False), (1, 0, 2, False), (2, 0, 8, False), (0, 1, 8, True)],
    mode="sketch_k=8",
    parquet=False,
).via("the review's latency groups")
@example(
    pushes=[(0, 0, 0, "ok", 1, 1), (1, 0, 0, "transient", 2, 4)],
    blocks=[(0, 0, 2, False), (1, 2, 8, False), (2, 1, 1, True)],
    mode="exact",
    parquet=True,
).via("linear interpolation")
def test_delivery_report_matches_the_documented_numbers(
    spark: Any,
    workdir: Path,
    pushes: list[tuple[int, int, int, str, int, int]],
    blocks: list[tuple[int, int, int, bool]],
    mode: str,
    parquet: bool,
) -> None:
    items = _pushes(pushes, blocks)
    option = "percentiles=exact" if mode == "exact" else mode
    out, result, records = _run(
        spark,
        REPORT,
        items,
        ["chart=false", option],
        workdir,
        file_format="parquet" if parquet else "jsonl",
    )
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    hours: dict[int, list[dict[str, Any]]] = defaultdict(list)
    reasons: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in records:
        h = _hour(r["ts"])
        groups[(h, r["plugin"], r["provider"], r["app_id"])].append(r)
        hours[h].append(r)
        reasons[(h, r["plugin"], r["provider"], r["app_id"], r["status"], r["reason"])] += 1

    summary = _parquet(out / "summary.parquet")
    assert not summary or list(summary[0]) == SUMMARY_COLUMNS
    got = {(_stamp(s["hour"]), s["plugin"], s["provider"], s["app_id"]): s for s in summary}
    assert len(got) == len(summary) and set(got) == set(groups)
    for key, rows in groups.items():
        _check_row(got[key], expected_report_row(rows, mode), key)

    hourly = _parquet(out / "hourly.parquet")
    assert not hourly or list(hourly[0]) == ["hour", *SUMMARY_COLUMNS[4:]]
    by_hour = {_stamp(s["hour"]): s for s in hourly}
    assert len(by_hour) == len(hourly) and set(by_hour) == set(hours)
    for h, rows in hours.items():
        _check_row(by_hour[h], expected_report_row(rows, mode), h)

    table = _parquet(out / "reasons.parquet")
    counted = {
        (_stamp(r["hour"]), r["plugin"], r["provider"], r["app_id"], r["status"], r["reason"]): r[
            "count"
        ]
        for r in table
    }
    assert len(counted) == len(table) and counted == reasons

    ok = sum(r["status"] == "ok" for r in records)
    assert result.metrics == {
        "receipts": len(records),
        "ok": ok,
        "success_rate": ok / len(records) if records else None,
        "hours": len(hours),
        "groups": len({key[1:] for key in groups}),
    }


# ---------------------------------------------------------------------- volume-anomalies

SOURCES = [  # (plugin, app_id, provider)
    ("matrix", "app.a", "apns"),
    ("matrix", "app.b", "fcm"),
    ("zulip", "app.a", None),
]
# source -> hour -> (ok, failures): sparse, so silent hours fall inside baselines
TRAFFIC = st.dictionaries(
    st.integers(0, len(SOURCES) - 1),
    st.dictionaries(st.integers(0, 14), st.tuples(st.integers(0, 30), st.integers(0, 12))),
    max_size=3,
)
ANOMALY_OPTIONS = st.fixed_dictionaries(
    {
        "by": st.sampled_from(["", "plugin", "provider", "plugin,app_id"]),
        "baseline_hours": st.sampled_from([1, 2, 4, 24]),
        "min_baseline_hours": st.sampled_from([1, 2, 4]),
        "factor": st.sampled_from([1.0, 1.5, 3.0]),
        "min_volume": st.sampled_from([0, 1, 20]),
        "min_failures": st.sampled_from([0, 1, 10]),
        "min_failure_rate": st.sampled_from([0.0, 0.01, 0.5]),
        # hours after the first one: before the newest receipt, after it, far after
        "now": st.one_of(
            st.none(),
            st.builds(
                lambda h, nudge: START + h * H / 2 + nudge,
                st.integers(0, 40),
                st.sampled_from([0.0, -0.000001, 0.5]),
            ),
        ),
    }
).map(lambda o: {**o, "min_baseline_hours": min(o["min_baseline_hours"], o["baseline_hours"])})


def _traffic(traffic: dict[int, dict[int, tuple[int, int]]]) -> list[Receipt]:
    """Each hour's receipts from its first instant to its last microsecond."""
    items = []
    for source, hours in traffic.items():
        plugin, app_id, provider = SOURCES[source]
        for hour, (ok, failed) in hours.items():
            statuses = ["ok"] * ok + ["transient"] * failed
            for i, status in enumerate(statuses):
                offset = 3599.999999 if i == len(statuses) - 1 and i else i * 60.0
                items.append(
                    _receipt(
                        START + hour * H + offset,
                        status,
                        token=None,
                        plugin=plugin,
                        app_id=app_id,
                        provider=provider,
                    )
                )
    return items


def expected_volume(
    records: list[dict[str, Any]], by: tuple[str, ...], n: int, now: float | None
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """docs/spark.md, `volume-anomalies`: (hour, *group) -> the volume table's row, for
    the hours the table lists (each hour with receipts and the n after it)."""
    volume: dict[tuple[Any, ...], int] = defaultdict(int)
    failed: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in records:
        key = (_hour(r["ts"]), *(r[c] for c in by))
        volume[key] += 1
        failed[key] += r["status"] != "ok"
    if not records:
        return {}
    end = now if now is not None else max(r["ts"] for r in records)
    last = max(h for h, *_ in volume)  # the newest hour in the data,
    if now is not None:  # or the last one that ended by `now`, when later
        last = max(last, max(h for h in range(_hour(now) - H, _hour(now) + 1, H) if h + H <= now))
    table = {}
    for group in {tuple(g) for _, *g in volume}:
        busy = sorted(h for h, *g in volume if tuple(g) == group)
        listed = {h + i * H for h in busy for i in range(n + 1) if h + i * H <= last}
        for h in sorted(listed):
            before = [h - i * H for i in range(1, n + 1) if h - i * H >= busy[0]]
            vol, fails = volume.get((h, *group), 0), failed.get((h, *group), 0)
            base_vol = sum(volume.get((b, *group), 0) for b in before)
            base_fail = sum(failed.get((b, *group), 0) for b in before)
            table[(h, *group)] = {
                "volume": vol,
                "failures": fails,
                "failure_rate": fails / vol if vol else None,
                "baseline_hours": len(before),
                "baseline_volume": base_vol / len(before) if before else None,
                "baseline_failure_rate": base_fail / base_vol if base_vol else None,
                "complete": h + H <= end,
            }
    return table


def expected_anomalies(
    table: dict[tuple[Any, ...], dict[str, Any]], opts: dict[str, Any]
) -> dict[tuple[Any, ...], float | None]:
    """(hour, *group, kind) -> ratio: the volume over its baseline mean, or the failure
    rate over the rate it was judged against (None when that is 0)."""
    factor, floor = opts["factor"], opts["min_failure_rate"]
    found: dict[tuple[Any, ...], float | None] = {}
    for key, row in table.items():
        if row["baseline_hours"] < opts["min_baseline_hours"]:
            continue
        vol, base = row["volume"], row["baseline_volume"]
        by_volume = vol / base if base else None
        if vol >= opts["min_volume"] and vol > factor * base:
            found[(*key, "volume_spike")] = by_volume
        if row["complete"] and base >= opts["min_volume"] and vol < base / factor:
            found[(*key, "volume_drop")] = by_volume
        judged_rate = max(row["baseline_failure_rate"] or 0.0, floor)
        rate = row["failure_rate"]
        spiked = rate is not None and rate > factor * judged_rate
        if row["failures"] >= opts["min_failures"] and spiked:
            found[(*key, "failure_spike")] = rate / judged_rate if judged_rate else None
    return found


def _anomaly_example(traffic: dict[int, dict[int, tuple[int, int]]], **opts: Any) -> Any:
    defaults = {
        "by": "plugin",
        "baseline_hours": 4,
        "min_baseline_hours": 2,
        "factor": 3.0,
        "min_volume": 1,
        "min_failures": 1,
        "min_failure_rate": 0.01,
        "now": None,
    }
    return example(traffic=traffic, opts={**defaults, **opts})


@SLOW
@given(traffic=TRAFFIC, opts=ANOMALY_OPTIONS)
# silent hours inside the baseline count as 0; a drop to silence after a busy run;
# a first hour with a short baseline; one failure in a tiny volume
@_anomaly_example({0: {0: (30, 0), 1: (30, 1), 5: (30, 0), 6: (2, 0)}, 2: {3: (0, 1)}})
@_anomaly_example(
    {0: {0: (30, 0), 1: (30, 0), 2: (25, 5)}, 1: {2: (1, 1)}},
    now=START + 9 * H,
    by="plugin,app_id",
)
@_anomaly_example({1: {0: (3, 0), 1: (0, 3), 2: (40, 0)}}, by="", min_failure_rate=0.0)
def test_volume_anomalies_match_the_documented_series(
    spark: Any,
    workdir: Path,
    traffic: dict[int, dict[int, tuple[int, int]]],
    opts: dict[str, Any],
) -> None:
    options = [f"{k}={v}" for k, v in opts.items() if v is not None]
    out, result, records = _run(spark, ANOMALIES, _traffic(traffic), options, workdir)
    by = tuple(c for c in opts["by"].split(",") if c)
    table = expected_volume(records, by, opts["baseline_hours"], opts["now"])

    rows = _parquet(out / "volume.parquet")
    columns = ["hour", *by, "volume", "failures", "failure_rate", "baseline_hours"]
    columns += ["baseline_volume", "baseline_failure_rate", "complete"]
    assert not rows or list(rows[0]) == columns
    got = {(_stamp(r["hour"]), *(r[c] for c in by)): r for r in rows}
    assert len(got) == len(rows)
    assert set(got) == set(table)
    for key, want in table.items():
        _check_row(got[key], want, key)
    assert result.metrics["group_hours"] == len(rows)

    found = expected_anomalies(table, opts)
    anomalies = _parquet(out / "anomalies.parquet")
    columns = ["hour", *by, "kind", "volume", "baseline_volume", "failures", "failure_rate"]
    assert not anomalies or list(anomalies[0]) == [*columns, "baseline_failure_rate", "ratio"]
    flagged = {(_stamp(a["hour"]), *(a[c] for c in by), a["kind"]): a for a in anomalies}
    assert len(flagged) == len(anomalies)
    assert set(flagged) == set(found)
    for key, ratio in found.items():
        row = table[key[:-1]]
        numbers = {c: row[c] for c in [*columns[len(by) + 2 :], "baseline_failure_rate"]}
        _check_row(flagged[key], {**numbers, "ratio": ratio}, key)
    assert result.metrics["anomalies"] == len(anomalies)
