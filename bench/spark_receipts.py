"""Benchmark: the Spark receipts jobs at 1M and 10M receipts, JSON Lines vs Parquet.

    .venv/bin/python bench/spark_receipts.py [--sizes 1000000,10000000] [--data DIR]
        [--json bench/results/spark_receipts.json] [--master local[*]] [--formats jsonl,parquet]

For each size, receipts are generated once (kept in `--data` and reused by later runs):
JSON Lines exactly as the gateway's writer lays them out (`receipt_record()` + the
writer's `json.dumps` settings, ~64 MiB files, written from a process pool:
`spark_plugins.synthetic.write_jsonl_fast`), and the same records as Parquet (snappy,
what a Parquet rollover of the writer would hold), converted by Spark.

Measured in one Spark session, per size and format (page cache warm: every input is
read once before the timed runs):

- `scan`: the bare scan, `count()` of the same files (`spark.read.text(...).count()` for
  JSON Lines: every byte read, lines split, nothing parsed; for Parquet `count()` is
  answered from the file footers, so `scan` is nearly free there);
- `records`: `count()` of the files read as JSON with the receipt schema (Spark
  tokenizes every line, converts no field); for Parquet the same as `scan`;
- `counted`: `spark.read.json(files).count()` as one would type it, Spark's defaults:
  the schema is inferred first, a pass that parses every line; for Parquet the same as
  `scan` (`spark.read.parquet(files).count()`);
- `read`: every value of the same files read with the receipt schema and dropped
  (Spark's `noop` sink, as Spark's own benchmarks time a scan): the bare scan of Parquet
  that reads its data, which `count()` does not;
- `parse`: the receipts reader's validated DataFrame counted (JSON parse + checks);
- `report`: the whole `delivery-report` job (tables, Parquet + CSV, chart, page).

Each is run `--runs` times (default 3) and the best kept: a first run also pays for the
JVM compiling Spark's generated code, and the scan is warm too. The report's first run
is shown as well.

Targets: report <= 3x scan; 10x the data <= 12x the time. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spark_plugins import delivery_report  # noqa: E402
from spark_plugins.reader import RECEIPT_DDL, read_receipts  # noqa: E402
from spark_plugins.session import get_session  # noqa: E402
from spark_plugins.synthetic import FAST_TOKENS, write_jsonl_fast  # noqa: E402

DATA_LAYOUT = "time-ordered-per-node"


def _size_label(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else str(n)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prepare(
    spark: Any, n: int, data: Path, formats: list[str], tokens: int = FAST_TOKENS
) -> dict[str, Path]:
    """Generated receipts (reused when present); `tokens` per plugin and generator process."""
    base = data / _size_label(n)
    if tokens != FAST_TOKENS:
        base = data / f"{_size_label(n)}-tokens{tokens}"
    jsonl, parquet = base / "jsonl", base / "parquet"
    marker = base / "count"
    layout = f"{n} {DATA_LAYOUT}"  # data of an older layout is generated again
    if not (marker.exists() and marker.read_text().strip() == layout):
        shutil.rmtree(base, ignore_errors=True)
        started = time.monotonic()
        print(f"generating {n:,} receipts in {jsonl} ...", file=sys.stderr, flush=True)
        written = write_jsonl_fast(n, jsonl, tokens=tokens)
        assert written == n, (written, n)
        print(f"  {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
        marker.write_text(layout)
    paths = {"jsonl": jsonl}
    if "parquet" in formats:
        if not (parquet / "_SUCCESS").exists():
            print(f"converting to Parquet in {parquet} ...", file=sys.stderr, flush=True)
            source = read_receipts(spark, str(jsonl))
            source.df.write.mode("overwrite").option("compression", "snappy").parquet(str(parquet))
            for crc in parquet.glob(".*.crc"):
                crc.unlink()
        paths["parquet"] = parquet
    return paths


def save_json(path: str, record: dict[str, Any]) -> None:
    """Write a benchmark's record (with when it ran) where `--json` says."""
    record = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def timed(fn: Any) -> tuple[float, Any]:
    started = time.monotonic()
    value = fn()
    return time.monotonic() - started, value


def best_of(runs: int, fn: Any) -> tuple[float, float, Any]:
    """(first run's seconds, best run's seconds, value): the JVM compiles Spark's generated
    code and warms up during a first run, so like is compared with like at the best."""
    times, value = [], None
    for _ in range(runs):
        seconds, value = timed(fn)
        times.append(seconds)
    return times[0], min(times), value


def measure(
    spark: Any, fmt: str, path: Path, out: Path, options: dict[str, Any], runs: int
) -> dict[str, Any]:
    glob = "*.jsonl" if fmt == "jsonl" else "*.parquet"

    def files() -> Any:
        # A new reader each time: a DataFrameReader keeps what it is told (a schema).
        return spark.read.option("recursiveFileLookup", "true").option("pathGlobFilter", glob)

    # Each baseline a count() of the same files; Parquet has one, its footer count.
    if fmt == "jsonl":
        baselines: dict[str, Callable[[], int]] = {
            "scan": lambda: files().text(str(path)).count(),
            "records": lambda: files().schema(RECEIPT_DDL).json(str(path)).count(),
            "counted": lambda: files().json(str(path)).count(),
        }
    else:
        baselines = {"scan": lambda: files().parquet(str(path)).count()}

    def report() -> Any:
        shutil.rmtree(out, ignore_errors=True)
        return delivery_report.JOB.run(spark, str(path), str(out), options)

    def read_all() -> None:
        source = files().schema(RECEIPT_DDL)
        frame = source.json(str(path)) if fmt == "jsonl" else source.parquet(str(path))
        frame.write.format("noop").mode("overwrite").save()

    baselines["scan"]()  # warm the page cache
    _, scan_s, rows = best_of(runs, baselines["scan"])
    records_s, in_records = counted_s, in_counted = scan_s, rows
    if fmt == "jsonl":
        _, records_s, in_records = best_of(runs, baselines["records"])
        _, counted_s, in_counted = best_of(runs, baselines["counted"])
    _, read_s, _ = best_of(runs, read_all)
    _, parse_s, parsed = best_of(runs, lambda: read_receipts(spark, str(path)).df.count())
    report_first_s, report_s, result = best_of(runs, report)
    counts = (rows, in_records, in_counted, parsed, result.metrics["receipts"])
    assert len(set(counts)) == 1, counts
    return {
        "format": fmt,
        "receipts": rows,
        "bytes": _du(path),
        "files": result.input.files,
        "runs": runs,
        "scan_s": round(scan_s, 2),
        "records_s": round(records_s, 2),
        "counted_s": round(counted_s, 2),
        "read_s": round(read_s, 2),
        "parse_s": round(parse_s, 2),
        "report_first_s": round(report_first_s, 2),
        "report_s": round(report_s, 2),
        "report_over_scan": round(report_s / scan_s, 2),
        "report_over_records": round(report_s / records_s, 2),
        "report_over_counted": round(report_s / counted_s, 2),
        "report_over_read": round(report_s / read_s, 2),
        "report_over_parse": round(report_s / parse_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--data", default=os.environ.get("PUSHGW_BENCH_DATA", "/tmp/pushgw-bench"))
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "spark_receipts.json"))
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--percentiles", default="sketch", choices=["sketch", "exact", "approx"])
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement (best kept)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    data = Path(args.data)
    spark = get_session(args.master, app_name="pushgw-bench")
    options = delivery_report.JOB.resolve_options({"percentiles": args.percentiles})
    results = []
    try:
        for n in sizes:
            paths = prepare(spark, n, data, formats)
            for fmt in formats:
                print(f"measuring {fmt} {n:,} ...", file=sys.stderr, flush=True)
                out = data / "out" / f"{n}-{fmt}"
                row = measure(spark, fmt, paths[fmt], out, options, args.runs)
                row["size"] = _size_label(n)
                results.append(row)
    finally:
        spark.stop()
    scaling = {}
    for fmt in formats:
        rows = sorted((r for r in results if r["format"] == fmt), key=lambda r: r["receipts"])
        if len(rows) >= 2:
            small, big = rows[0], rows[-1]
            scaling[fmt] = {
                "data_ratio": round(big["receipts"] / small["receipts"], 1),
                "scan_ratio": round(big["scan_s"] / small["scan_s"], 2),
                "report_ratio": round(big["report_s"] / small["report_s"], 2),
            }
    header = f"{'size':>5} {'format':8} {'MB':>6} {'scan s':>7} {'records s':>9} {'counted s':>9} "
    header += f"{'read s':>6} {'parse s':>7} {'report s':>8} {'(first)':>7} {'rep/scan':>8} "
    header += f"{'rep/records':>11} {'rep/counted':>11} {'rep/read':>8} {'rep/parse':>9}"
    print(header)
    for r in results:
        print(
            f"{r['size']:>5} {r['format']:8} {r['bytes'] / 2**20:6.0f} {r['scan_s']:7.2f} "
            f"{r['records_s']:9.2f} {r['counted_s']:9.2f} {r['read_s']:6.2f} "
            f"{r['parse_s']:7.2f} {r['report_s']:8.2f} {r['report_first_s']:7.2f} "
            f"{r['report_over_scan']:8.2f} {r['report_over_records']:11.2f} "
            f"{r['report_over_counted']:11.2f} {r['report_over_read']:8.2f} "
            f"{r['report_over_parse']:9.2f}"
        )
    for fmt, s in scaling.items():
        print(
            f"scaling {fmt}: {s['data_ratio']}x data -> scan {s['scan_ratio']}x, "
            f"report {s['report_ratio']}x time"
        )
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    record = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_after": load,
        },
        "master": args.master,
        "percentiles": args.percentiles,
        "results": results,
        "scaling": scaling,
    }
    save_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
