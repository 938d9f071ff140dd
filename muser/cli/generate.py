"""`muser generate`: run a lane on a prompt, stream the text, print statistics."""

from __future__ import annotations

import argparse
import json
import sys

from muser.cli._common import add_model_args, add_sampling_args
from muser.errors import RefusedError


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
    from muser.cli._common import (
        TextStreamer,
        encode_prompt,
        local_width,
        open_models,
        read_prompt,
        sampling_params,
        stats_table,
    )

    params = sampling_params(args)
    text = read_prompt(args)
    if args.lane == "cluster":
        from muser.cli.cluster_client import generate_cluster

        if args.width is not None or args.draft_range is not None:
            raise RefusedError(
                "--width/--draft-range are local-lane flags: with --lane cluster the "
                "cluster's lane.width decides (pass --draft-len to fix D)"
            )

        return generate_cluster(args, params, text)
    if args.lane == "plain" and (args.width is not None or args.draft_range is not None):
        raise RefusedError(
            "--width/--draft-range are local-lane flags; --lane plain drafts nothing"
        )
    width = local_width(args) if args.lane == "local" else None  # refused before loading
    models = open_models(args, need_draft=args.lane == "local")
    prompt = encode_prompt(models.tokenizer, text)
    from verifier_gx.admission import check_room, check_stop_tokens

    # before any token: what the cluster's verifier refuses at open, refused here the same way
    check_room(len(prompt), params, models.target.geometry.context_length)
    check_stop_tokens(params, models.target.identity.vocab_size)
    streamer = None if args.json else TextStreamer(models.tokenizer)
    if streamer:
        sys.stdout.write(text)
    if args.lane == "plain":
        from verifier_gx.plain import run_plain

        result = run_plain(models.target, prompt, params, on_tokens=streamer)
    else:
        from proposer_mac.local_lane import run_local

        result = run_local(
            models.target,
            models.draft,
            prompt,
            params,
            draft_len=args.draft_len,
            q_top_k=args.q_top_k,
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
            ]
        )
    )
    return 0


def _by_width(hist: dict[int, int]) -> str:
    return " ".join(f"D={d}:{n}" for d, n in sorted(hist.items())) or "-"
