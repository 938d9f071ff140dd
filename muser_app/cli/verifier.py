"""`muser verifier serve --config FILE`: run the verifier daemon until SIGTERM/SIGINT.

Prints `verifier listening on HOST:PORT key=<key id>` to stderr once it serves. A bad
cluster file, key or commit log is refused with exit code 2 and a message saying what to fix.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from muser import logs


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = actions.add_parser(
        "serve",
        help="serve muser.v2.Verifier on verifier.address until SIGTERM/SIGINT",
        description="Recover the commit log, load the target, sign and serve rounds.",
    )
    s.add_argument("--config", type=Path, required=True, help="cluster.toml")
    logs.add_arguments(s)
    s.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from cluster_config import load_config
    from muser_app.checks import check_config
    from verifier_gx.daemon import serve

    config = load_config(args.config)
    check_config(config, role="verifier", receipt=False)  # create_server checks the receipt
    logs.configure(args.log_level, args.log_format)
    serve(config)
    return 0
