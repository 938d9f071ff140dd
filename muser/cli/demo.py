"""`muser demo`: the README's first command.

Builds (or reuses) the fixtures, then generates from a few natural prompts with the text
appearing live, and prints a table against plain target decode.
"""

from __future__ import annotations

import argparse
import sys


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--prompts", type=int, default=3, help="natural prompts to stream (default 3)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-len", type=int, default=4)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from muser.cli._common import TextStreamer, encode_prompt, stats_table
    from muser.fixtures import build_fixtures, natural_prompts
    from muser.sampling import SamplingParams
    from muser.stats import LaneStats
    from proposer_mac.backends import load_draft_backend
    from proposer_mac.local_lane import run_local
    from verifier_gx.backends import load_target_backend
    from verifier_gx.plain import run_plain

    print("== fixtures", file=sys.stderr)
    pair = build_fixtures(progress=True).natural
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    target = load_target_backend("torch", pair.target)
    draft = load_draft_backend("torch", pair.draft)
    totals = {"plain": LaneStats(), "local": LaneStats()}
    for i, text in enumerate(natural_prompts(args.prompts)):
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i
        )
        prompt = encode_prompt(tokenizer, text)
        print(f"\n== prompt {i + 1}/{args.prompts} (local lane, text streams as it commits)")
        sys.stdout.write(text)
        target.reset()
        draft.reset()
        local = run_local(
            target,
            draft,
            prompt,
            params,
            draft_len=args.draft_len,
            on_tokens=TextStreamer(tokenizer),
        )
        target.reset()
        plain = run_plain(target, prompt, params)
        if params.greedy and plain.tokens != local.tokens:
            print("\nERROR: the local lane differs from plain decode", file=sys.stderr)
            return 1
        for name, r in (("plain", plain), ("local", local)):
            t = totals[name]
            t.rounds += r.stats.rounds
            t.drafted += r.stats.drafted
            t.accepted += r.stats.accepted
            t.emitted += r.stats.emitted
            t.wall_s += r.stats.wall_s
            t.draft_s += r.stats.draft_s
            t.verify_s += r.stats.verify_s
        print()
    plain, local = totals["plain"], totals["local"]
    print("\n== statistics")
    print(
        stats_table(
            [
                ("plain target decode", f"{plain.tokens_per_s:.1f} tok/s"),
                (
                    "local lane",
                    f"{local.tokens_per_s:.1f} tok/s ({local.tokens_per_s / plain.tokens_per_s:.2f}× plain)",
                ),
                ("acceptance", f"{local.acceptance:.3f} ({local.accepted}/{local.drafted})"),
                ("tokens per round", f"{local.tokens_per_round:.2f} (includes the next frontier)"),
                ("round split", f"draft {local.draft_s:.2f} s, verify {local.verify_s:.2f} s"),
                (
                    "greedy exactness",
                    "identical to plain decode" if args.temperature == 0 else "n/a (sampled)",
                ),
            ]
        )
    )
    return 0
