"""The benchmark's fast receipt writer lays files out as gateway nodes would."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from gateway.core.receipts import receipt_record
from spark_plugins import synthetic

START = 1_735_689_600.0
HOURS = 6


def test_fast_writer_files_cover_stretches_of_time_per_node(tmp_path: Path) -> None:
    written = synthetic.write_jsonl_fast(
        2_001, tmp_path, workers=2, per_file=250, start=START, hours=HOURS
    )
    assert written == 2_001
    by_node: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(tmp_path.glob("receipts-*.jsonl")):
        by_node[path.name.split("-")[2]].append(path)
    assert sorted(by_node) == ["0", "1"]
    assert sorted(len(files) for files in by_node.values()) == [4, 5]  # 1,000 and 1,001
    total = 0
    for files in by_node.values():
        previous_end = START
        for path in files:
            times = [json.loads(line)["ts"] for line in path.read_text().splitlines()]
            total += len(times)
            assert times == sorted(times)  # appended as pushes finish
            assert previous_end <= times[0] and times[-1] < START + HOURS * 3600
            previous_end = times[-1]
    assert total == 2_001


def test_fast_writer_lines_are_the_writers_records(tmp_path: Path) -> None:
    synthetic.write_jsonl_fast(50, tmp_path, workers=1, seed=3, start=START, hours=HOURS)
    lines = next(tmp_path.glob("*.jsonl")).read_text().splitlines()
    ordered = synthetic.receipts(
        50, seed=3000, start=START, hours=HOURS, tokens=200_000, in_time_order=True
    )
    expected = [json.dumps(receipt_record(r), separators=(",", ":")) for r in ordered]
    assert lines == expected


def test_receipts_fall_anywhere_in_the_window_unless_ordered() -> None:
    shuffled = [r.finished_at for r in synthetic.receipts(500, seed=1, start=START, hours=HOURS)]
    assert shuffled != sorted(shuffled)
    assert all(START <= t < START + HOURS * 3600 for t in shuffled)
