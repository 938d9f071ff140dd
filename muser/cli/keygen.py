"""`muser keygen --out DIR [--name NAME]`: an Ed25519 key pair (PEM; private key 0600)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--out", type=Path, required=True, help="directory to write the keys into")
    p.add_argument(
        "--name",
        action="append",
        default=None,
        help="key pair name (repeatable; default: verifier and proposer)",
    )
    p.add_argument("--force", action="store_true", help="overwrite existing key files")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def write_keys(out: Path, names: list[str], force: bool = False) -> dict[str, dict]:
    from muser import keys
    from muser.errors import RefusedError

    written = {}
    for name in names:
        private_path, public_path = out / f"{name}.key", out / f"{name}.pub"
        if private_path.exists() and not force:
            raise RefusedError(f"{private_path} exists; pass --force to overwrite it")
        key = keys.generate()
        keys.write_keypair(key, private_path, public_path)
        written[name] = {
            "private": str(private_path),
            "public": str(public_path),
            "key_id": keys.key_id(key.public_key()),
        }
    return written


def run(args: argparse.Namespace) -> int:
    written = write_keys(args.out, args.name or ["verifier", "proposer"], args.force)
    if args.json:
        print(json.dumps(written))
    else:
        for name, info in written.items():
            print(f"{name}: {info['private']} (public {info['public']}, key id {info['key_id']})")
    return 0
