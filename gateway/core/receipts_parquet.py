"""Receipts as Parquet (`receipts.format: parquet`, the default): converting a finished
JSON Lines file, and reading one back (`pushgw receipts cat`).

Needs pyarrow, a base dependency; `gateway.core.receipts` imports this module only when
the format is Parquet, and reports a missing pyarrow there (files then stay JSON Lines).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

# The documented record (docs/receipts.md) with its nullability; integers are int64, as
# the Spark reader's RECEIPT_FIELDS expect (spark_plugins/reader.py).
SCHEMA = pa.schema(
    [
        pa.field("v", pa.int64(), nullable=False),
        pa.field("ts", pa.float64(), nullable=False),
        pa.field("push_id", pa.string(), nullable=False),
        pa.field("plugin", pa.string(), nullable=False),
        pa.field("app_id", pa.string(), nullable=False),
        pa.field("provider", pa.string()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("http_status", pa.int64()),
        pa.field("reason", pa.string()),
        pa.field("attempts", pa.int64(), nullable=False),
        pa.field("latency_ms", pa.float64(), nullable=False),
        pa.field("token_hash", pa.string()),
    ]
)


def convert(source: Path, target: Path) -> int:
    """Write the receipts of the JSON Lines file `source` to `target` (Parquet, snappy).

    Returns the number of lines left out because they are not JSON (a line cut short by
    a crash). A record that parses but does not fit the schema raises: such a file is
    not the writer's, and it is better kept as JSON Lines than half converted.

    A line Arrow's 1 MiB blocks cannot hold (it refuses one straddling more than two:
    a provider's long error text in `reason`, say) is read too: the second pass, which
    has each line, sizes the block to the longest. One such receipt kept its whole file
    (an hour's receipts) JSON Lines.
    """
    try:
        table, skipped = _read_json(str(source)), 0
    except pa.ArrowInvalid:
        data, skipped, longest = _parsable_lines(source)
        block = max(_BLOCK_SIZE, longest + 1)
        table = _read_json(pa.BufferReader(data), block) if data else SCHEMA.empty_table()
    pq.write_table(table.cast(SCHEMA), target, compression="snappy")
    return skipped


# What `records` reads: the schema's types, nulls shown where they are (another
# writer's file may hold some in a required column; the Spark jobs skip such rows).
_READ_SCHEMA = pa.schema([field.with_nullable(True) for field in SCHEMA])


def record_batches(path: Path) -> Iterator[list[dict[str, Any]]]:
    """The receipts of a Parquet receipts file, a batch of rows at a time (Arrow's,
    64Ki rows), one documented record each: the schema's fields in its order and with
    its types, so each encodes as the writer's JSON line.

    Raises ValueError for a Parquet file without a receipt column, and pyarrow's errors
    for one that is not Parquet or holds a column of another type.
    """
    parquet = pq.ParquetFile(path)
    present = parquet.schema_arrow.names
    missing = [name for name in SCHEMA.names if name not in present]
    if missing:
        raise ValueError(f"not a receipts file: no column {missing[0]!r}")
    # Parquet allows a name twice (another tool's file); Arrow then cannot select the
    # column by name and raises KeyError, which is no reader's error to expect.
    for name in SCHEMA.names:
        if (count := present.count(name)) > 1:
            raise ValueError(f"not a receipts file: column {name!r} appears {count} times")
    for batch in parquet.iter_batches(columns=SCHEMA.names):
        table = pa.Table.from_batches([batch]).select(SCHEMA.names).cast(_READ_SCHEMA)
        yield _finite(table).to_pylist()


_FLOAT_COLUMNS = [i for i, field in enumerate(SCHEMA) if pa.types.is_floating(field.type)]


def _finite(table: pa.Table) -> pa.Table:
    """NaN and infinities (another writer's; ours never writes them) as nulls: JSON has
    no such numbers, and the Spark jobs skip such a row as they skip a null."""
    for i in _FLOAT_COLUMNS:
        column = table.column(i)
        if pc.any(pc.invert(pc.is_finite(column))).as_py():
            table = table.set_column(
                i, SCHEMA.field(i).name, pc.if_else(pc.is_finite(column), column, None)
            )
    return table


_BLOCK_SIZE = pa_json.ReadOptions().block_size  # Arrow's default, 1 MiB


def _read_json(source: str | pa.NativeFile, block_size: int = _BLOCK_SIZE) -> pa.Table:
    # Arrow's parser releases the GIL, so the event loop keeps running meanwhile; one
    # thread leaves the other cores to the gateway. A record must fit in one block.
    return pa_json.read_json(
        source,
        read_options=pa_json.ReadOptions(use_threads=False, block_size=block_size),
        parse_options=pa_json.ParseOptions(
            explicit_schema=SCHEMA, unexpected_field_behavior="ignore"
        ),
    )


def _parsable_lines(source: Path) -> tuple[bytes, int, int]:
    """The lines of `source` that are JSON objects, how many others were dropped, and
    the length of the longest line kept (its newline included)."""
    kept: list[bytes] = []
    skipped = longest = 0
    with source.open("rb") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                ok = isinstance(json.loads(line), dict)
            except ValueError:  # UnicodeDecodeError included
                ok = False
            if ok:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
                longest = max(longest, len(kept[-1]))
            else:
                skipped += 1
    return b"".join(kept), skipped, longest
