"""`muser generate`: run a lane on a prompt, stream the text, print statistics."""

from __future__ import annotations

import argparse
import json
import sys

from muser.errors import RefusedError
from muser_app.cli._common import DEFAULT_Q_TOP_K, add_model_args, add_sampling_args


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument(
        "--lane",
        choices=["plain", "local", "cluster"],
        default="local",
        help="plain: target alone (the oracle); local: draft+target in one process; "
        "cluster: a client of the proposer daemon (needs --config)",
    )
    src = p.add_argument_group("prompt (default: a held-out natural prompt)")
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    add_sampling_args(p)
    add_model_args(p)
    p.add_argument("--config", help="cluster.toml (for --lane cluster)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from muser_app.cli._common import (
        TextStreamer,
        encode_prompt,
        local_tree,
        local_width,
        open_models,
        read_prompt,
        sampling_params,
        stats_table,
    )

    params = sampling_params(args)
    check_lane_flags(args)
    text = read_prompt(args)
    if args.lane == "cluster":
        from muser_app.cli.cluster_client import generate_cluster

        check_wire_ranges(args, params)
        return generate_cluster(args, params, text)
    tree = local_tree(args) if args.lane == "local" else None  # refused before loading
    width = local_width(args) if args.lane == "local" and tree is None else None
    models = open_models(args, need_draft=args.lane == "local")
    prompt = encode_prompt(models.tokenizer, text)
    from muser.sampling import check_stop_tokens
    from verifier_gx.admission import check_room

    # before any token: what the cluster's verifier refuses at open, refused here the same way
    check_room(len(prompt), params, models.target.geometry.context_length)
    check_stop_tokens(params, models.target.identity.vocab_size)
    streamer = None if args.json else TextStreamer(models.tokenizer)
    if streamer:
        sys.stdout.write(text)
    if args.lane == "plain":
        from muser_app.lanes.plain import run_plain

        result = run_plain(models.target, prompt, params, on_tokens=streamer)
    elif tree is not None:
        from muser_app.lanes.tree import run_local_tree

        result = run_local_tree(
            models.target,
            models.draft,
            prompt,
            params,
            policy=tree,
            q_top_k=DEFAULT_Q_TOP_K if args.q_top_k is None else args.q_top_k,
            on_tokens=streamer,
        )
    else:
        from muser_app.lanes.local import run_local

        result = run_local(
            models.target,
            models.draft,
            prompt,
            params,
            draft_len=args.draft_len,
            q_top_k=DEFAULT_Q_TOP_K if args.q_top_k is None else args.q_top_k,
            on_tokens=streamer,
            width=width,
        )
    result.text = models.tokenizer.decode(result.tokens)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    s = result.stats
    print("\n")
    print(
        stats_table(
            [
                ("lane", result.lane),
                ("prompt tokens", str(result.prompt_tokens)),
                ("generated tokens", str(len(result.tokens))),
                ("rounds", str(s.rounds)),
                ("acceptance", f"{s.acceptance:.3f} ({s.accepted}/{s.drafted})"),
                ("tokens per round", f"{s.tokens_per_round:.2f}"),
                ("wall", f"{s.wall_s:.3f} s"),
                ("tokens/s", f"{s.tokens_per_s:.1f}"),
                ("split draft/verify", f"{s.draft_s:.3f} s / {s.verify_s:.3f} s"),
                ("rounds by D", _by_width(s.draft_len_hist)),
                *_tree_rows(s),
            ]
        )
    )
    return 0


CLUSTER_DECIDES = {
    "target": "its verifier.target in cluster.toml decides",
    "draft": "its proposer.draft in cluster.toml decides",
    "target_backend": "its verifier.backend in cluster.toml decides",
    "draft_backend": "its proposer.backend in cluster.toml decides",
    "draft_window": "the proposer's draft attends to its whole context",
    "q_top_k": "its lane.q_top_k in cluster.toml decides",
    "context_length": "the target's checkpoint decides, on the verifier",
    "rope_theta": "the target's checkpoint decides, on the verifier",
    "width": "its lane.width in cluster.toml decides (--draft-len asks for one D)",
    "draft_range": "its lane.draft_len_min and lane.draft_len_max decide",
    "tree_nodes": "its lane.tree_nodes in cluster.toml decides",
}
"""Flags a cluster lane does not take, and why: what decides them there instead."""

DRAFT_FLAGS = ("draft", "draft_backend", "draft_len", "draft_window", "q_top_k", "width")
DRAFT_FLAGS += ("draft_range", "tree_nodes")
"""Flags of the draft, which --lane plain does not run."""


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_lane_flags(args: argparse.Namespace) -> None:
    """Refuse, before any work, a flag the chosen lane would not use (a flag that silently
    does nothing is worse than none)."""
    if args.lane == "cluster":
        for dest, where in CLUSTER_DECIDES.items():
            if getattr(args, dest) is not None:
                raise RefusedError(f"{_flag(dest)} is not taken by --lane cluster: {where}")
        if args.draft_len is not None and args.draft_len < 1:
            raise RefusedError(
                f"--draft-len {args.draft_len} received; --lane cluster takes 1 to 64 (a "
                "session that asks for nothing gets the cluster's lane.draft_len; for D = 0, "
                "set lane.draft_len = 0 there)"
            )
        return
    if args.config is not None:
        raise RefusedError(f"--config is for --lane cluster; --lane {args.lane} runs in process")
    if args.lane == "plain":
        for dest in DRAFT_FLAGS:
            if getattr(args, dest) is not None:
                raise RefusedError(f"{_flag(dest)} is a draft flag; --lane plain drafts nothing")
    if args.q_top_k is not None and args.q_top_k < 1:
        raise RefusedError(f"--q-top-k {args.q_top_k} received; expected >= 1")


UINT32 = 2**32 - 1


def check_wire_ranges(args: argparse.Namespace, params) -> None:
    """What goes on the wire as a uint32 must fit one (the proposer refuses what its cluster
    cannot serve, with its own message)."""
    for flag, value in (
        ("--max-tokens", params.max_tokens),
        ("--top-k", params.top_k),
        ("--draft-len", args.draft_len or 0),
        *(("--stop-token", t) for t in params.stop_tokens),
    ):
        if not 0 <= value <= UINT32:
            raise RefusedError(f"{flag} {value} received; expected 0 to {UINT32}")


def _tree_rows(s) -> list[tuple[str, str]]:
    """The stats table's tree line, for a lane that drafted trees."""
    if not s.tree_shape:
        return []
    per_round = s.tree_nodes / max(1, s.rounds)
    shape = ",".join(map(str, s.tree_shape))
    return [("tree", f"nodes per depth {shape}; {s.tree_nodes} nodes ({per_round:.1f} a round)")]


def _by_width(hist: dict[int, int]) -> str:
    return " ".join(f"D={d}:{n}" for d, n in sorted(hist.items())) or "-"
