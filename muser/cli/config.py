"""`muser config init|check|show`: write, check and print the cluster file."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

TEMPLATE = """\
# muser-cluster: a single-machine cluster (both daemons on loopback), written by
# `muser config init`. Paths are relative to this file.

[verifier]
address = "127.0.0.1:{verifier_port}"
key = "keys/verifier.key"
public_key = "keys/verifier.pub"
wal_dir = "wal/verifier"
target = "{target}"
backend = "torch"

[proposer]
address = "127.0.0.1:{proposer_port}"
key = "keys/proposer.key"
public_key = "keys/proposer.pub"
wal_dir = "wal/proposer"
draft = "{draft}"
backend = "{draft_backend}"

[lane]
draft_len = {draft_len}
q_top_k = 32

[enrolment]
verifiers = ["keys/verifier.pub"]
proposers = ["keys/proposer.pub"]

[limits]
max_sessions = 64
max_message_bytes = 8388608
max_tokens = 4096
"""


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="write a working loopback cluster into DIR")
    init.add_argument("--dir", type=Path, required=True)
    init.add_argument("--target", type=Path, help="target checkpoint (default: the fixtures)")
    init.add_argument("--draft", type=Path, help="draft checkpoint (default: the fixtures)")
    init.add_argument("--draft-backend", choices=["torch", "mlx"], default="torch")
    init.add_argument("--draft-len", type=int, default=4)
    init.add_argument("--force", action="store_true", help="overwrite an existing cluster.toml")
    init.set_defaults(func=run_init)
    check = actions.add_parser("check", help="validate a cluster file (exit 0 ok, 2 refused)")
    check.add_argument("config", type=Path)
    check.set_defaults(func=run_check)
    show = actions.add_parser("show", help="print the resolved configuration")
    show.add_argument("config", type=Path)
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=run_show)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_cluster(
    directory: Path,
    *,
    target: Path | None = None,
    draft: Path | None = None,
    draft_backend: str = "torch",
    draft_len: int = 4,
    force: bool = False,
) -> Path:
    from muser.cli.keygen import write_keys
    from muser.errors import RefusedError

    path = directory / "cluster.toml"
    if path.exists() and not force:
        raise RefusedError(f"{path} exists; pass --force to overwrite it")
    if target is None or draft is None:
        from muser.cli._common import default_pair

        fixture_target, fixture_draft = default_pair()
        target, draft = target or fixture_target, draft or fixture_draft
    directory.mkdir(parents=True, exist_ok=True)
    write_keys(directory / "keys", ["verifier", "proposer"], force=True)
    path.write_text(
        TEMPLATE.format(
            verifier_port=free_port(),
            proposer_port=free_port(),
            target=Path(target).resolve(),
            draft=Path(draft).resolve(),
            draft_backend=draft_backend,
            draft_len=draft_len,
        )
    )
    return path


def run_init(args: argparse.Namespace) -> int:
    path = init_cluster(
        args.dir,
        target=args.target,
        draft=args.draft,
        draft_backend=args.draft_backend,
        draft_len=args.draft_len,
        force=args.force,
    )
    print(f"wrote {path}")
    print(f"  muser verifier serve --config {path}")
    print(f"  muser proposer serve --config {path}")
    print(f"  muser status --config {path} --wait 60")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from cluster_config import load_config
    from cluster_config.rules import check_rules

    check_rules(load_config(args.config))
    print(f"{args.config}: ok")
    return 0


def run_show(args: argparse.Namespace) -> int:
    from cluster_config import load_config

    cfg = load_config(args.config).model_dump(mode="json")
    print(json.dumps(cfg, indent=None if args.json else 2))
    return 0
