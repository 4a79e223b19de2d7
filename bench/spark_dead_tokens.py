"""Benchmark: `dead-tokens` over generated receipts, with its aggregation settings and Spark's.

    .venv/bin/python bench/spark_dead_tokens.py [--sizes 10000000] [--tokens 200000,2000]
        [--formats parquet,jsonl] [--data DIR] [--json bench/results/spark_dead_tokens.json]

The receipts are those of `bench/spark_receipts.py` (same generator and directory, so
the data is shared); `--tokens` is the number of device tokens per plugin and generator
process: 200,000 (the default data) gives 1.2M tokens of about 8 receipts each over
14 days at 10M receipts, 2,000 gives about 20,000 tokens of 500 receipts each.

For each size, token count and format, in one Spark session, best of `--runs` (the
first run is shown too, it also pays for compiling Spark's generated code):

- `job`: the whole job as shipped (`dead_tokens.aggregation_conf`: no partial
  aggregation before the shuffle, tokens kept in a hash map);
- `spark defaults`: the same job with Spark's own aggregation settings
  (`dead_tokens.run.__wrapped__`), the job's speed before it tuned them.

Both must write the same file; the table says how many tokens were seen and retired.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from spark_receipts import _size_label, best_of, prepare, save_json  # noqa: E402

from spark_plugins import dead_tokens  # noqa: E402
from spark_plugins.session import get_session  # noqa: E402


def measure(spark: Any, path: Path, out: Path, runs: int) -> dict[str, Any]:
    options = dead_tokens.JOB.resolve_options({})

    def job(run: Any = dead_tokens.run) -> Any:
        shutil.rmtree(out, ignore_errors=True)
        result = run(spark, str(path), str(out), options)
        digest = hashlib.sha256((out / dead_tokens.FILE).read_bytes()).hexdigest()
        return result, digest

    first, best, (result, digest) = best_of(runs, job)
    # the job without its aggregation settings (what it ran as before it had them)
    untuned = functools.partial(job, dead_tokens.run.__wrapped__)  # type: ignore[attr-defined]
    default_first, default_best, (_, default_digest) = best_of(runs, untuned)
    assert digest == default_digest, "the settings changed the dead-token file"
    return {
        "receipts": result.input.records,
        "tokens_seen": result.metrics["tokens_seen"],
        "tokens_retired": result.metrics["tokens_retired"],
        "job_first_s": round(first, 2),
        "job_s": round(best, 2),
        "spark_defaults_first_s": round(default_first, 2),
        "spark_defaults_s": round(default_best, 2),
        "speedup": round(default_best / best, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000000")
    parser.add_argument("--tokens", default="200000,2000")
    parser.add_argument("--formats", default="parquet,jsonl")
    parser.add_argument("--data", default=os.environ.get("PUSHGW_BENCH_DATA", "/tmp/pushgw-bench"))
    parser.add_argument(
        "--json", default=str(ROOT / "bench" / "results" / "spark_dead_tokens.json")
    )
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement (best kept)")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    data = Path(args.data)
    spark = get_session(args.master, app_name="pushgw-bench")
    results = []
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            for tokens in (int(t) for t in args.tokens.split(",")):
                paths = prepare(spark, n, data, formats, tokens)
                for fmt in formats:
                    print(f"measuring {fmt} {n:,} x{tokens} ...", file=sys.stderr, flush=True)
                    out = data / "out" / f"dead-{n}-{tokens}-{fmt}"
                    row = measure(spark, paths[fmt], out, args.runs)
                    row.update(size=_size_label(n), tokens_per_process=tokens, format=fmt)
                    results.append(row)
    finally:
        spark.stop()
    print(
        f"{'size':>5} {'format':8} {'tokens':>9} {'retired':>8} {'job s':>6} {'(first)':>7} "
        f"{'defaults s':>10} {'(first)':>7} {'speedup':>7}"
    )
    for r in results:
        print(
            f"{r['size']:>5} {r['format']:8} {r['tokens_seen']:9,} {r['tokens_retired']:8,} "
            f"{r['job_s']:6.1f} {r['job_first_s']:7.1f} {r['spark_defaults_s']:10.1f} "
            f"{r['spark_defaults_first_s']:7.1f} {r['speedup']:6.2f}x"
        )
    record = {"machine": {"cpus": os.cpu_count()}, "master": args.master, "runs": args.runs}
    save_json(args.json, {**record, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
