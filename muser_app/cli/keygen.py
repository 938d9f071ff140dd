"""`muser keygen --out DIR [--name NAME] [--tls [--host H]]`: the cluster's key material.

Ed25519 key pairs sign round requests and results (PEM; private keys 0600). With `--tls`,
also a cluster CA and ECDSA P-256 certificates under DIR/tls (see muser.tls): one per name
plus a `client` certificate for the CLI, valid for loopback and every `--host`.
"""

from __future__ import annotations

import argparse
import json
import re
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
    p.add_argument(
        "--tls",
        action="store_true",
        help="also write a CA and TLS certificates under DIR/tls (mutual TLS)",
    )
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="DNS name or IP the server certificates are also valid for (repeatable; "
        "127.0.0.1, ::1 and localhost always are)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
HOST = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*"
)


def check_names(names: list[str]) -> None:
    """A name is a file name in --out: letters, digits, '_', '.', '-', not starting with a
    dot, and each once."""
    from muser.errors import RefusedError

    for name in names:
        if not NAME.fullmatch(name):
            raise RefusedError(
                f"--name {name!r} received; expected letters, digits, '_', '.' or '-', "
                "starting with a letter or digit (it names files in --out)"
            )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RefusedError(f"--name {twice[0]} given twice; each key pair is named once")


def check_host(host: str) -> None:
    """A certificate host: an IP address or a DNS name."""
    import ipaddress

    from muser.errors import RefusedError

    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not HOST.fullmatch(host):
        raise RefusedError(f"--host {host!r} received; expected a DNS name or an IP address")


def refuse_taken(paths: list[Path], force: bool) -> None:
    """Checked before anything is written, so a refusal leaves no half-written set."""
    from muser.errors import RefusedError

    taken = [p for p in paths if p.exists()]
    if taken and not force:
        raise RefusedError(f"{taken[0]} exists; pass --force to overwrite it")


def write_keys(out: Path, names: list[str], force: bool = False) -> dict[str, dict]:
    from muser import keys

    refuse_taken([out / f"{n}.key" for n in names], force)
    written = {}
    for name in names:
        private_path, public_path = out / f"{name}.key", out / f"{name}.pub"
        key = keys.generate()
        keys.write_keypair(key, private_path, public_path)
        written[name] = {
            "private": str(private_path),
            "public": str(public_path),
            "key_id": keys.key_id(key.public_key()),
        }
    return written


def run(args: argparse.Namespace) -> int:
    from muser.errors import RefusedError

    names = args.name or ["verifier", "proposer"]
    check_names(names)
    if args.out.exists() and not args.out.is_dir():
        raise RefusedError(f"--out {args.out} is a file; expected a directory (or a new path)")
    for host in args.host:
        check_host(host)
    if args.host and not args.tls:
        raise RefusedError("--host names TLS certificate hosts; add --tls")
    if args.tls and "client" in names:
        raise RefusedError("--name client is reserved for the CLI's TLS certificate")
    tls_written = {}
    if args.tls:
        from muser.tls import private_paths, write_tls

        refuse_taken([args.out / f"{n}.key" for n in names], args.force)
        refuse_taken(private_paths(args.out / "tls", names), args.force)
        tls_written = write_tls(args.out / "tls", names, args.host, force=args.force)
    written = write_keys(args.out, names, args.force)
    if args.json:
        print(json.dumps({**written, "tls": tls_written} if args.tls else written))
        return 0
    for name, info in written.items():
        print(f"{name}: {info['private']} (public {info['public']}, key id {info['key_id']})")
    for name, info in tls_written.items():
        print(f"tls {name}: {info['cert']} (key {info['key']})")
    return 0
