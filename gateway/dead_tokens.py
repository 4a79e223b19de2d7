"""Dead-token files: what the Spark `dead-tokens` job writes and `pushgw tokens retire` reads.

The format (docs/spark.md, `dead-tokens`) is JSON Lines, one object per token. `DeadToken`
describes one line; `read_dead_tokens` checks a whole file against it, so that a bad file
is refused before anything is applied (docs/cli.md, `pushgw tokens retire FILE`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from pydantic_core import ErrorDetails

from gateway.core.push import ProviderKind

# Hex HMAC-SHA256 of the token, as receipts carry it.
TOKEN_HASH = r"^[0-9a-f]{64}$"

# No control characters (newline, tab, NUL...): the values are printed one line each,
# stored in the database (PostgreSQL refuses NUL) and handed to the plugins.
NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"

Text = Annotated[str, Field(pattern=NO_CONTROL)]
NonEmpty = Annotated[str, Field(min_length=1, pattern=NO_CONTROL)]


class DeadTokenFileError(ValueError):
    """A dead-token file that cannot be read or is not in the format; `str()` is one line."""


class DeadToken(BaseModel):
    """One line of a dead-token file; `line` is its line number in the file (1-based).

    Keys other than these are ignored. Fields are listed in the order they are checked:
    the first wrong one is reported.
    """

    model_config = ConfigDict(strict=True, frozen=True, allow_inf_nan=False, extra="ignore")

    plugin: NonEmpty
    app_id: NonEmpty
    token_hash: Annotated[str, Field(min_length=1, pattern=TOKEN_HASH)]
    provider: ProviderKind | None = None
    reason: Text | None = None
    failures: Annotated[int, Field(ge=0)] | None = None
    last_seen: float | None = None  # unix seconds

    _line: int = PrivateAttr(default=0)

    def model_post_init(self, context: Any, /) -> None:
        if isinstance(context, dict):
            self._line = int(context.get("line", 0))

    @property
    def line(self) -> int:
        return self._line


def read_dead_tokens(path: Path) -> tuple[list[DeadToken], int]:
    """Every token of a dead-token file and the number of duplicate lines.

    The whole file is checked before anything is applied: DeadTokenFileError names the
    first bad line (file:line) and how many more there are.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DeadTokenFileError(f"{path}: {exc.strerror or exc}") from None
    tokens: list[DeadToken] = []
    seen: set[tuple[str, str, str]] = set()
    duplicates = 0
    problems: list[str] = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            token = _dead_token(number, raw)
        except ValueError as exc:
            problems.append(f"{path}:{number}: {exc}")
            continue
        if token is None:
            continue
        key = (token.plugin, token.app_id, token.token_hash)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        tokens.append(token)
    if problems:
        more = len(problems) - 1
        tail = f" ({more} more bad line{'s' if more > 1 else ''})" if more else ""
        raise DeadTokenFileError(f"{problems[0]}{tail}; nothing was retired")
    _check_job_result(path, len(tokens) + duplicates)
    return tokens, duplicates


JOB_FILE = "dead-tokens.jsonl"  # what the Spark `dead-tokens` job writes in its --out
JOB_RESULT = "result-dead-tokens.json"  # its completion marker, written after JOB_FILE


def _check_job_result(path: Path, lines: int) -> None:
    """The job's own file beside its completion marker must hold as many tokens as the
    marker says the run wrote (`tokens_retired`): fewer is a cut-short copy, more or
    fewer a changed file, and either would retire a different set than the job found.
    Without a marker (a file of another name or place, or a run that did not finish:
    the job removes it first) there is nothing to compare with."""
    if path.name != JOB_FILE:
        return
    try:
        result = json.loads(path.with_name(JOB_RESULT).read_bytes())
    except (OSError, ValueError):
        return
    metrics = result.get("metrics") if isinstance(result, dict) else None
    written = metrics.get("tokens_retired") if isinstance(metrics, dict) else None
    if type(written) is int and written != lines:
        raise DeadTokenFileError(
            f"{path}: holds {lines} token{'s' if lines != 1 else ''}, but {JOB_RESULT} "
            f"beside it says the dead-tokens run wrote {written}: the file is incomplete "
            "or was changed; nothing was retired"
        )


def _dead_token(number: int, raw: bytes) -> DeadToken | None:
    """One line (None if blank); ValueError says what is wrong, in one line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    if not text.strip():
        return None
    try:
        return DeadToken.model_validate_json(text, context={"line": number})
    except ValidationError as exc:
        # Only the first problem, and never str(exc): it shows the input, and a mistaken
        # file could hold device tokens in clear.
        raise ValueError(_problem(exc.errors()[0])) from None


def _problem(error: ErrorDetails) -> str:
    """What is wrong, for one of pydantic's errors; token_hash values are never shown."""
    kind, value = error["type"], error["input"]
    if kind == "json_invalid":
        reason = str(error.get("ctx", {}).get("error", ""))
        if reason.startswith("recursion limit exceeded"):
            return "not a dead-token record (JSON nested too deeply)"
        reason = reason.replace(" at line 1 column ", " at column ")  # one line is parsed
        return f"not a dead-token record (not JSON: {reason})"
    if not error["loc"]:
        return f"not a dead-token record (a JSON {_json_type(value)}, not an object)"
    field = str(error["loc"][0])
    if field == "token_hash" and kind == "string_pattern_mismatch":
        return (
            "token_hash: must be 64 lowercase hex characters, the receipts' keyed "
            f"HMAC-SHA256 (got {len(value)} characters)"
        )
    if field in ("plugin", "app_id", "reason") and kind == "string_pattern_mismatch":
        return f"{field}: must not hold control characters (newline, tab, NUL...)"
    if field in ("plugin", "app_id", "token_hash"):
        got = {"missing": "missing", "string_too_short": "empty"}.get(kind)
        return f"{field}: must be a non-empty string ({got or f'a {_json_type(value)}'})"
    if field == "provider":
        names = ", ".join(f'"{p.value}"' for p in ProviderKind)
        return f"provider: must be {names} or null, not {json.dumps(value)[:40]}"
    if field == "reason":
        return f"reason: must be a string or null (a {_json_type(value)})"
    if field == "failures":
        return "failures: must be a whole number >= 0"
    if field == "last_seen":
        return "last_seen: must be a number (unix seconds)"
    return f"{field}: {error['msg']}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else "object"
