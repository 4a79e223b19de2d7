"""Benchmark: what the Parquet receipts format costs the writer when a file rolls.

    .venv/bin/python bench/receipts_parquet.py [--mib 64] [--runs 5]
        [--json var/bench/receipts_parquet.json]

The gateway's `ReceiptWriter` writes generated receipts (`spark_plugins.synthetic`,
with as many device tokens as `bench/spark_receipts.py`) into one JSON Lines file of
`--mib` MiB (the default `receipts.roll_bytes`); then the conversion the writer thread
runs at each roll (`gateway.core.receipts_parquet.convert`) is timed on it, `--runs` times. Printed
and written: wall and CPU seconds (best and median), microseconds of CPU per receipt,
the Parquet file's size against the JSON Lines one, and the most memory Arrow's pool
held during a conversion. A separate process does the conversions, so that the
receipts generated for the file do not count in its memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BYTES_PER_RECEIPT = 290  # about, for the generator's receipts: only sizes the batch


def write_file(directory: Path, mib: int) -> Path:
    """One JSON Lines receipts file of about `mib` MiB, written by the real writer."""
    from spark_plugins import synthetic

    count = mib * 1024 * 1024 // BYTES_PER_RECEIPT
    # as many device tokens as bench/spark_receipts.py's data: few repeat within a file,
    # the case that compresses least
    items = list(
        synthetic.receipts(
            count, seed=5, hours=24, tokens=synthetic.FAST_TOKENS, in_time_order=True
        )
    )
    roll = mib * 1024 * 1024 + 1024 * 1024  # one file: the writer rolls at close
    synthetic.write_with_receipt_writer(items, directory, roll_bytes=roll)
    (path,) = directory.glob("*.jsonl")
    return path


def convert_runs(source: Path, runs: int) -> dict[str, Any]:
    """In this process: `runs` conversions of `source`, timed."""
    import pyarrow as pa

    from gateway.core import receipts_parquet

    target = source.with_suffix(".parquet")
    walls, cpus = [], []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        receipts_parquet.convert(source, target)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    with source.open("rb") as lines:
        receipts = sum(1 for _ in lines)
    return {
        "receipts": receipts,
        "jsonl_bytes": source.stat().st_size,
        "parquet_bytes": target.stat().st_size,
        "wall_s": walls,
        "cpu_s": cpus,
        "arrow_peak_bytes": pa.default_memory_pool().max_memory(),
    }


def _best_median(seconds: list[float]) -> str:
    return f"best {min(seconds):.3f} s, median {statistics.median(seconds):.3f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=str(ROOT / "var" / "bench" / "receipts_parquet.json"))
    parser.add_argument("--convert", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.convert:  # the measuring process
        print(json.dumps(convert_runs(Path(args.convert), args.runs)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="pushgw-bench-parquet-"))
    try:
        source = write_file(work, args.mib)
        child = subprocess.run(
            [sys.executable, __file__, "--convert", str(source), "--runs", str(args.runs)],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(child.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["cores"] = os.cpu_count()
    cpu_best = min(result["cpu_s"])
    rows = [
        ("receipts in the file", f"{result['receipts']:,}"),
        ("JSON Lines", f"{result['jsonl_bytes'] / 2**20:.1f} MiB"),
        (
            "Parquet",
            f"{result['parquet_bytes'] / 2**20:.1f} MiB "
            f"({result['jsonl_bytes'] / result['parquet_bytes']:.1f}x smaller)",
        ),
        ("conversion, wall", _best_median(result["wall_s"])),
        ("conversion, CPU", _best_median(result["cpu_s"])),
        ("CPU per receipt", f"{cpu_best / result['receipts'] * 1e6:.2f} us"),
        ("Arrow memory, peak", f"{result['arrow_peak_bytes'] / 2**20:.0f} MiB"),
    ]
    print(f"Parquet conversion of one rolled receipts file ({result['cores']} cores)")
    for name, value in rows:
        print(f"  {name:<22} {value}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
