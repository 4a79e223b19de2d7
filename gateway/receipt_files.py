"""Reading published receipts files back as JSON Lines (`pushgw receipts cat`).

The Parquet format keeps receipts out of reach of text tools; this gives them back as
the writer wrote them, so `jq` and `grep` work on either format. A directory is read as
the Spark jobs read it: its `*.jsonl` and `*.parquet` files, recursively, never the
`.jsonl.open` and `.parquet.tmp` files still being written, nor hidden (`.`) or
underscore-prefixed entries, which Spark also leaves out.
"""

from __future__ import annotations

import gzip
import json
import stat
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from gateway.core.receipts import record_line

PUBLISHED_SUFFIXES = (".jsonl", ".parquet")
_CHUNK = 1 << 20  # bytes of a JSON Lines file read at once
_PARQUET_MAGIC = b"PAR1"  # the first (and last) bytes of every Parquet file
_GZIP_MAGIC = b"\x1f\x8b"  # the first bytes of a gzip file (RFC 1952)


class Output(Protocol):
    """Where `copy_receipts` writes: a binary stream."""

    def write(self, data: bytes, /) -> object: ...


class ReceiptFileError(Exception):
    """A receipts file that cannot be read; the message names the file and what is wrong."""


def published_files(
    directory: Path, on_error: Callable[[ReceiptFileError], None] | None = None
) -> list[Path]:
    """The published receipts files under `directory`, in file-name order.

    A file's name starts with the UTC time it was opened (docs/receipts.md), so this is
    the order receipts were written in, across the writers and hosts of a directory.
    A directory that cannot be listed, or an entry that cannot be looked at, raises
    ReceiptFileError, or, with `on_error` (as `os.walk`'s `onerror`), is passed to it
    and left out. A file reached by two names (a symbolic or hard link to it in the
    tree) is listed once, by the first name in that order: its receipts are not
    printed twice.
    """
    found = [
        path for path in _walk(directory, on_error, set()) if path.suffix in PUBLISHED_SUFFIXES
    ]
    files: list[Path] = []
    seen: set[tuple[int, int]] = set()
    for path in sorted(found, key=lambda path: (path.name, str(path))):
        try:
            info = path.stat()  # through a symbolic link: the file it leads to
        except FileNotFoundError:  # a dangling link, or gone since it was listed
            continue
        except OSError as exc:
            _report(path, exc, on_error)
            continue
        if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            files.append(path)
    return files


def _walk(
    directory: Path,
    on_error: Callable[[ReceiptFileError], None] | None,
    seen: set[tuple[int, int]],
) -> Iterator[Path]:
    """The entries under `directory`; a directory reached again through a symbolic link
    (a loop, or two links to one place) is read once."""
    try:
        info = directory.stat()
        if (info.st_dev, info.st_ino) in seen:
            return
        seen.add((info.st_dev, info.st_ino))
        entries = sorted(directory.iterdir())
    except OSError as exc:
        _report(directory, exc, on_error)
        return
    for entry in entries:
        if entry.name.startswith((".", "_")):
            continue
        try:
            # Raises for EACCES (a directory readable but not searchable lists its
            # names, but none can be looked at); hides only ENOENT and the like.
            is_dir = entry.is_dir()
        except OSError as exc:
            _report(entry, exc, on_error)
            continue
        if is_dir:
            yield from _walk(entry, on_error, seen)
        else:
            yield entry


def _report(path: Path, exc: OSError, on_error: Callable[[ReceiptFileError], None] | None) -> None:
    error = ReceiptFileError(f"{path}: {_why(exc)}")
    if on_error is None:
        raise error from None
    on_error(error)


def copy_receipts(path: Path, out: Output) -> None:
    """Write the receipts of one file to `out` as JSON Lines (see `receipt_chunks`).

    Only reading the file raises ReceiptFileError; an error writing `out` (a reader gone
    away, a full disk) propagates as it is.
    """
    for chunk in receipt_chunks(path):
        out.write(chunk)


def receipt_chunks(path: Path) -> Iterator[bytes]:
    """The receipts of one file as JSON Lines, in pieces: a megabyte of a JSON Lines
    file, a batch of a Parquet file's rows.

    A Parquet file (told by its first bytes, whatever its name) gives its rows as the
    writer wrote them before converting them, byte for byte; a gzip-compressed file (an
    operator's archived `.jsonl.gz`, also told by its first bytes) is decompressed; any
    other file is given as it is, as JSON Lines (a last line cut short by a crash
    included, then ended with a newline). Raises ReceiptFileError when the file cannot
    be read.
    """
    try:
        magic = _magic(path)
        if magic == _PARQUET_MAGIC:
            yield from _parquet_chunks(path)
        elif magic.startswith(_GZIP_MAGIC):
            yield from _line_chunks(path, compressed=True)
        else:
            yield from _line_chunks(path)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        # never the bytes as they are: a text tool would get binary for receipts
        problem = f"gzip-compressed data cut short or damaged ({type(exc).__name__})"
        raise ReceiptFileError(f"{path}: {problem}") from None
    except (OSError, ValueError) as exc:
        raise ReceiptFileError(f"{path}: {_why(exc)}") from None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The receipts of a directory (its published files) or of one file, as records:
    for scripts and tests. Raises ReceiptFileError, or ValueError for a line that is
    not JSON."""
    data = b"".join(
        chunk
        for file in (published_files(path) if path.is_dir() else [path])
        for chunk in receipt_chunks(file)
    )
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _magic(path: Path) -> bytes:
    with path.open("rb") as source:
        return source.read(len(_PARQUET_MAGIC))


def _line_chunks(path: Path, *, compressed: bool = False) -> Iterator[bytes]:
    last = b"\n"
    try:
        with gzip.open(path, "rb") if compressed else path.open("rb") as source:
            # read1: gzip gives what it decompressed so far, so a file cut short
            # still gives the lines before the cut (as a crash's `.jsonl` does)
            while chunk := source.read1(_CHUNK):
                yield chunk
                last = chunk[-1:]
    except (OSError, EOFError, zlib.error):
        if last != b"\n":  # the next file's first line must not join a cut one
            yield b"\n"
        raise
    if last != b"\n":
        yield b"\n"


def _parquet_chunks(path: Path) -> Iterator[bytes]:
    import pyarrow as pa

    from gateway.core import receipts_parquet

    try:
        for batch in receipts_parquet.record_batches(path):
            yield "".join(map(record_line, batch)).encode()
    except (pa.ArrowException, OSError) as exc:
        # The file system's error (with an errno) is said as such; Arrow's own OSError
        # for a damaged file ("Couldn't deserialize thrift") has none: the file's fault.
        if isinstance(exc, OSError) and exc.errno is not None:
            raise
        problem = f"not a readable receipts Parquet file ({_why(exc)})"
        raise ReceiptFileError(f"{path}: {problem}") from None


def _why(exc: Exception) -> str:
    # A system error and our own ValueError say what is wrong without quoting content;
    # a parser's message may quote the bytes it choked on, so only its kind is shown.
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if type(exc) is ValueError:
        return str(exc)
    return type(exc).__name__
