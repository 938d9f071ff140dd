"""Entry point of the `muser` CLI.

Each subcommand lives in its own module under `muser_app.cli` exposing
`register(subparsers) -> None`; its heavy imports (torch, grpc, mlx) happen inside the
function the parser dispatches to, so `muser --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Order is the order shown in --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("muser_app.cli.generate", "generate text (lanes: plain, local, cluster)"),
    "keygen": (
        "muser_app.cli.keygen",
        "write Ed25519 key pairs (--tls: a CA and mTLS certificates)",
    ),
    "config": ("muser_app.cli.config", "write, check and show the cluster file"),
    "qualify": ("muser_app.cli.qualify", "qualify the lane against plain decode; sign a receipt"),
    "verifier": ("muser_app.cli.verifier", "the verifier daemon (target, commit WAL, signatures)"),
    "proposer": ("muser_app.cli.proposer", "the proposer daemon (draft, journal, client API)"),
    "status": ("muser_app.cli.status", "health and statistics of both daemons"),
    "fixtures": ("muser_app.cli.fixtures", "build the fixture target/draft pair"),
    "bench": ("muser_app.cli.bench", "benchmark lanes and peers, with receipts"),
    "wal": ("muser_app.cli.wal", "inspect, verify and repair a write-ahead log directory"),
    "demo": (
        "muser_app.cli.demo",
        "build fixtures, start a loopback cluster, generate, print stats",
    ),
}

EPILOG = """exit codes:
  0  success
  1  a check failed (wal verify found a bad record, a comparison differed)
  2  refused: bad arguments, invalid configuration or input (message says what to change)
  3  a runtime error (a daemon unreachable, a model failed to load)
  130  interrupted (Ctrl-C; for `muser bench` also SIGTERM, after it kept a partial receipt)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="muser",
        description="muser-cluster: lossless speculative decoding across two machines.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from muser import __version__

    parser.add_argument("--version", action="version", version=f"muser-cluster {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.register(sub, name, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from muser.errors import MuserError

    try:
        return int(args.func(args) or 0)
    except MuserError as exc:
        print(f"muser {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
