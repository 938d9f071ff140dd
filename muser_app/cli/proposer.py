"""`muser proposer serve --config FILE`: the proposer daemon (draft + client API)."""

from __future__ import annotations

import argparse

from muser import logs


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = actions.add_parser("serve", help="run the proposer daemon until SIGTERM/SIGINT")
    serve.add_argument("--config", required=True, help="cluster.toml")
    logs.add_arguments(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from cluster_config import load_config
    from muser_app.checks import check_config
    from proposer_mac.daemon import serve

    config = load_config(args.config)
    check_config(config, role="proposer")
    logs.configure(args.log_level, args.log_format)
    serve(config)
    return 0
