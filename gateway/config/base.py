"""The base of every config model (`ConfigModel`) and the file-path field types.

`ConfigModel` forbids unknown keys and fills a secret `X` from a key `X_file`
(`read_secret_file`); `ExistingFile` and `TrustStore` check a path at start-up; in every
path, `HomePath` included, `~` is the home directory (`expand_home`).
Core sections, provider apps and plugins' sections all build on these.
"""

from __future__ import annotations

import os
import ssl
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# pydantic exports the handler at its top level only from 2.11; pyproject allows 2.7
from pydantic.functional_validators import ModelWrapValidatorHandler

from gateway.config.errors import _key_error


def _file_problem(path: Path) -> str | None:
    """Why `path` is not a regular file (without opening it), or None.

    A named pipe, a device or a socket is refused before anything reads it: reading a
    named pipe waits for a writer, for ever."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "file not found"
    except OSError as exc:
        return f"cannot read the file ({exc.strerror or type(exc).__name__})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISFIFO: "a named pipe",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    kind = next((name for test, name in kinds.items() if test(mode)), "a special file")
    return f"not a regular file ({kind})"


def expand_home(value: str | os.PathLike[str]) -> Path:
    """`value` with a leading `~` or `~user` made that home directory, as in a shell.

    Every path option goes through this, so that `~` means the same everywhere. Raises
    ValueError (not pathlib's RuntimeError, which would be a traceback) for a `~user`
    that names no user, or a `~` with no home directory: kept literal, it would make a
    directory named `~` in the working directory."""
    expanded = os.path.expanduser(os.fspath(value))
    if expanded.startswith("~"):
        head = expanded.split(os.sep, 1)[0]
        raise ValueError(f"cannot expand {head}: no such user or home directory")
    return Path(expanded)


HomePath = Annotated[Path, AfterValidator(expand_home)]
"""A path option (a directory, a file yet to be made): `~` is the home directory, as in
`ExistingFile` and every `X_file`; a relative path is relative to the working directory."""


def _existing_file(value: Path) -> Path:
    path = expand_home(value)
    if problem := _file_problem(path):
        raise ValueError(problem)
    return path


ExistingFile = Annotated[Path, AfterValidator(_existing_file)]
"""A path that must name a regular file at start-up ("file not found", "is a directory,
not a file", "not a regular file (a named pipe)" otherwise)."""


def _trust_store(path: Path) -> Path:
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, OSError):
        raise ValueError("not a PEM trust store (no CA certificate loads from it)") from None
    return path


TrustStore = Annotated[Path, AfterValidator(_existing_file), AfterValidator(_trust_store)]
"""A file of PEM CA certificates, loaded at start-up."""


def read_secret_file(value: Any) -> str:
    """The secret in the file `value` names: UTF-8 text, trailing newlines stripped.

    Raises ValueError with a message fit for the operator (never the file's content):
    not a path, no such file, a directory, not a regular file (a named pipe would be
    waited on for ever), unreadable, not UTF-8, or empty.
    """
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ValueError("expected the path of a file")
    path = expand_home(value)
    if problem := _file_problem(path):
        raise ValueError(problem)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError("file not found") from None
    except IsADirectoryError:
        raise ValueError("is a directory, not a file") from None
    except OSError as exc:
        raise ValueError(f"cannot read the file ({exc.strerror or type(exc).__name__})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the file is not UTF-8 text") from None
    text = text.rstrip("\n")
    if not text.strip():
        raise ValueError("the file is empty")
    return text


SECRETS_FROM_FILES_MASK = "pushgw_secrets_from_files_mask"
"""A serialization context key: `model_dump(context={SECRETS_FROM_FILES_MASK: "***"})`
shows every value a `ConfigModel` read from an `X_file` as "***" (`pushgw check-config`)."""


class ConfigModel(BaseModel):
    """Base of every config section: unknown keys are errors; `X_file` fills secret `X`.

    A key `password_file: /run/secrets/pw` sets the field `password` to the file's
    content (trailing newline stripped) when the model has a field `password` and
    no field `password_file`. Setting both `password` and `password_file` is an error,
    and so is a file that is missing, a directory, not UTF-8 text, or empty
    (`read_secret_file`). Plugins derive their section models from this.

    The fields so filled are remembered: whatever their names, the operator said they
    are secrets by putting them in a file, and a masked dump (`SECRETS_FROM_FILES_MASK`)
    hides them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    _from_files: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="wrap")
    @classmethod
    def _secrets_from_files(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        data, from_files = cls._read_secret_files(data)
        model = handler(data)
        if from_files:  # (private attributes may be set on a frozen model)
            model._from_files = from_files
        return model

    @classmethod
    def _read_secret_files(cls, data: Any) -> tuple[Any, frozenset[str]]:
        """`data` with each `X_file` key replaced by `X`, the file's content; and the Xs."""
        if not isinstance(data, Mapping):
            return data, frozenset()
        out = dict(data)
        targets: set[str] = set()
        for key, value in data.items():
            if not (isinstance(key, str) and key.endswith("_file")):
                continue
            target = key[: -len("_file")]
            if key in cls.model_fields or target not in cls.model_fields:
                continue
            if target in data:
                raise _key_error(key, f"set {target} or {key}, not both")
            try:
                out[target] = read_secret_file(value)
            except ValueError as exc:
                raise _key_error(key, str(exc)) from None
            del out[key]
            targets.add(target)
        return out, frozenset(targets)

    # No return annotation on purpose: pydantic would take it for the schema of the
    # model's serialized form (`model_json_schema(mode="serialization")`).
    @model_serializer(mode="wrap")
    def _mask_secrets_from_files(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ):
        dumped = handler(self)
        mask = (info.context or {}).get(SECRETS_FROM_FILES_MASK) if self._from_files else None
        if mask is None or not isinstance(dumped, dict):
            return dumped
        for name in self._from_files:
            field = type(self).model_fields[name]
            key = (field.serialization_alias or field.alias or name) if info.by_alias else name
            if key in dumped:
                dumped[key] = mask
        return dumped
