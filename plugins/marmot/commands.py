"""`pushgw marmot ...` commands for operators.

- `pushgw marmot keygen [--secret-file PATH] [--json]`: a new server key pair. With
  `--secret-file`, the secret (hex) is written to a new file readable by the owner only and only the
  public parts are printed; use that file as `server_secret_key_file`.
- `pushgw marmot pubkey --config FILE`: the npub/hex of the configured server key, to hand to
  clients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from plugins.marmot.keys import ServerKey, nsec_encode

__all__ = ["add_commands", "cmd_keygen", "cmd_pubkey"]


def add_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    marmot = subparsers.add_parser("marmot", help="Marmot notification server tools")
    sub = marmot.add_subparsers(dest="marmot_command", metavar="COMMAND")
    keygen = sub.add_parser("keygen", help="generate a server key pair (npub/nsec, hex)")
    keygen.add_argument(
        "--secret-file", help="write the secret key (hex) to this new file (mode 0600)"
    )
    keygen.add_argument("--json", action="store_true", help="print JSON")
    keygen.set_defaults(handler=cmd_keygen)
    pubkey = sub.add_parser("pubkey", help="print the configured server public key")
    # Unset unless given here: `pushgw -c FILE marmot pubkey` keeps the FILE given before.
    pubkey.add_argument(
        "--config",
        "-c",
        default=argparse.SUPPRESS,
        help="config file (default: $PUSHGW_CONFIG)",
    )
    pubkey.add_argument("--json", action="store_true", help="print JSON")
    pubkey.set_defaults(handler=cmd_pubkey)
    marmot.set_defaults(handler=lambda args, ctx: (marmot.print_help(), 2)[1])


def _usage_error(message: str) -> int:
    """A mistake to fix first: one line on stderr, exit status 2 (docs/cli.md)."""
    print(f"pushgw marmot: {message}", file=sys.stderr)
    return 2


def _emit(data: dict[str, str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2))
        return
    width = max(len(k) for k in data)
    for k, v in data.items():
        print(f"{k + ':':<{width + 1}} {v}")


def cmd_keygen(args: argparse.Namespace, _ctx: Any) -> int:
    key = ServerKey.generate()
    data = {"npub": key.npub, "pubkey_hex": key.pubkey_hex}
    if args.secret_file:
        try:
            fd = os.open(args.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return _usage_error(f"--secret-file {args.secret_file}: exists; not overwritten")
        except OSError as exc:
            return _usage_error(f"--secret-file {args.secret_file}: {exc.strerror}")
        with os.fdopen(fd, "w") as fh:
            fh.write(key.secret.hex() + "\n")
        data["secret_key_file"] = str(args.secret_file)
    else:
        data["nsec"] = nsec_encode(key.secret)
        data["secret_key_hex"] = key.secret.hex()
    _emit(data, args.json)
    return 0


def cmd_pubkey(args: argparse.Namespace, ctx: Any) -> int:
    from plugins.marmot.config import MarmotConfig

    loaded = ctx.load()
    context = loaded.contexts.get("marmot")
    if context is None or not isinstance(context.config, MarmotConfig):
        return _usage_error("the marmot plugin is not enabled in this configuration")
    key = context.config.server_key
    _emit({"npub": key.npub, "pubkey_hex": key.pubkey_hex}, args.json)
    return 0
