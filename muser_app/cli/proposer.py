"""`muser proposer serve --config FILE`: the proposer daemon (draft + client API)."""

from __future__ import annotations

import argparse

from muser import logs


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = actions.add_parser("serve", help="run the proposer daemon until SIGTERM/SIGINT")
    serve.add_argument("--config", required=True, help="cluster.toml")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names the OpenAI-compatible API serves the target under (http.served_model_name; "
        "the first is the one responses carry; default: the target checkpoint's folder name)",
    )
    logs.add_arguments(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from cluster_config import load_config
    from muser_app.checks import check_config
    from proposer_mac.daemon import serve

    config = with_flags(load_config(args.config), args)
    check_config(config, role="proposer")
    logs.configure(args.log_level, args.log_format)
    serve(config)
    return 0


def with_flags(config, args: argparse.Namespace):
    """The cluster file's configuration with the command line's overrides applied (each flag
    is the long form of one key)."""
    if args.served_model_name:
        http = config.http.model_copy(update={"served_model_name": list(args.served_model_name)})
        config = config.model_copy(update={"http": http})
    return config
