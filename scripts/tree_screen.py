"""The tree admission screen (issue 33): tokens emitted per target call, and what one tree
call costs against a one-token decode, for tree shapes of growing node counts against the
chain at the same depth, greedy and T = 1, on one pair; all in one run on one machine.
Writes a JSON receipt and a PNG.

A shape is children per depth (`3,2,1`: uniform) or `best:N`: the best-first template of N
nodes, four deep, that `muser.tree_width.AdaptiveTree` draws each round from the acceptance
by rank it has measured so far (one policy through all prompts of a temperature, as one
long session; it starts from its prior, every rank 1 in 2).

    python scripts/tree_screen.py --pair toy --prompts 4 --max-tokens 96 \\
        --receipt docs/receipts/tree-screen-toy-session28.json --png docs/tree-screen-toy.png
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ["1,1,1,1", "2,1,1,1", "4,1,1,1", "3,2,1,1", "4,2,1,1", "4,2,2,1", "4,3,2,1"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="toy", help="pair name (default toy)")
    p.add_argument("--draft-kind", default="trained", choices=["trained", "conditioned"],
                   help="which of the pair's drafts drafts the trees (default trained)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--shapes", nargs="+", default=SHAPES,
                   help="children per depth (e.g. 3,2,1) or best:N (a learned best-first "
                        "template of N nodes)")  # fmt: skip
    p.add_argument("--receipt", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--replot", type=Path, metavar="RECEIPT", help="only draw RECEIPT's rows")
    args = p.parse_args(argv)
    if args.replot is not None:
        receipt = json.loads(args.replot.read_text())
        plot(receipt["rows"], receipt["pair"], args.png, receipt.get("draft", "trained"))
        return 0

    import torch
    from transformers import AutoTokenizer

    from muser.sampling import SamplingParams
    from muser.tree_width import nodes_per_depth
    from muser_app.lanes.plain import run_plain
    from muser_app.lanes.tree import run_local_tree
    from muser_app.pairs import pair_prompts, resolve
    from muser_torch.backend import TorchBackend
    from proposer_mac.backends import load_draft_backend

    torch.set_num_threads(1)
    models = resolve(args.pair, args.draft_kind)
    target = TorchBackend(models.target)
    draft = load_draft_backend(models.draft_backend or "torch", models.draft)
    tokenizer = AutoTokenizer.from_pretrained(str(models.target))
    prompts = [
        list(tokenizer.encode(t, add_special_tokens=False))
        for t in pair_prompts(models.pair, args.prompts, tokenizer)
    ]
    rows, templates = [], {}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=args.seed)
        plain_s = plain_tokens = 0
        for prompt in prompts:
            target.reset()
            got = run_plain(target, prompt, params)
            plain_s, plain_tokens = plain_s + got.stats.wall_s, plain_tokens + len(got.tokens)
        decode_s = plain_s / plain_tokens  # one-token decode, prompt prefill amortised in
        for shape in args.shapes:
            policy = shape_policy(shape)
            emitted = calls = accepted = 0
            verify_s = wall_s = 0.0
            for prompt in prompts:
                s = run_local_tree(target, draft, prompt, params, policy=policy).stats
                emitted, calls, accepted = (
                    emitted + s.emitted,
                    calls + s.rounds,
                    accepted + s.accepted,
                )
                verify_s, wall_s = verify_s + s.verify_s, wall_s + s.wall_s
            template = policy.choose(10**9)
            templates.setdefault(shape, template)  # (the greedy run's, for the forward cost)
            rows.append({
                "temperature": temperature, "shape": shape, "nodes": len(template),
                "nodes_per_depth": nodes_per_depth(template),
                "depth": len(nodes_per_depth(template)), "tokens_per_call": emitted / calls,
                "accepted_per_call": accepted / calls,
                "round_cost_vs_decode": (verify_s / calls) / decode_s,
                "tokens_per_s": emitted / wall_s, "plain_tokens_per_s": plain_tokens / plain_s,
            })  # fmt: skip
            r = rows[-1]
            print(f"T={temperature} {shape:>9} nodes={r['nodes']:>3} "
                  f"per depth={','.join(map(str, r['nodes_per_depth']))} tokens/call="
                  f"{r['tokens_per_call']:.2f} round/decode={r['round_cost_vs_decode']:.2f} "
                  f"lane/plain={r['tokens_per_s'] / r['plain_tokens_per_s']:.2f}", flush=True)  # fmt: skip
    forward = forward_costs(target, prompts[0], templates)
    for r in rows:
        r["forward_cost_vs_decode"] = forward[r["shape"]]
    receipt = {
        "what": "tree admission screen (scripts/tree_screen.py)",
        "pair": models.pair, "draft": args.draft_kind, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "seed": args.seed, "machine": platform.processor() or platform.machine(),
        "threads": 1, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
    }  # fmt: skip
    if args.receipt:
        args.receipt.write_text(json.dumps(receipt, indent=1) + "\n")
    if args.png:
        plot(rows, models.pair, args.png, args.draft_kind)
    return 0


def shape_policy(shape: str):
    """The tree policy a screen shape names: uniform children per depth, or best:N."""
    from muser.tree_width import AdaptiveTree, FixedTree
    from muser_app.lanes.tree import parse_branching

    if shape.startswith("best:"):
        nodes = int(shape.removeprefix("best:"))
        return AdaptiveTree(budget=nodes, depth=4, sizes=[nodes])
    return FixedTree(parse_branching(shape))


def forward_costs(target, prompt: list[int], templates: dict, repeats: int = 15) -> dict:
    """Per shape: the median wall of one target tree forward of its template over the
    prompt's KV, over the median wall of a one-token decode there (the tree's tokens do not
    move its cost)."""
    import statistics

    seq = target.sequence()
    seq.evaluate(prompt)

    def median_s(run) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def decode() -> None:
        seq.evaluate([prompt[-1]])
        seq.rollback(1)

    one = median_s(decode)
    out = {}
    for shape, template in templates.items():
        parents = list(template)
        tokens = [prompt[i % len(prompt)] for i in range(len(parents) + 1)]

        def tree(parents=parents, tokens=tokens) -> None:
            target.evaluate_tree(seq, tokens, parents)
            seq.keep_path([])
            seq.rollback(1)

        out[shape] = median_s(tree) / one
    return out


def plot(rows: list[dict], pair: str, path: Path, draft: str = "trained") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for learned, color in ((False, "C0"), (True, "C3")):
        kind = "best-first, learned" if learned else "children per depth"
        # uniform shapes share node counts (16,1,1,1 and 4,3,2,1): points, not a line
        for temperature, style in (
            (0.0, "o-" if learned else "o"),
            (1.0, "s--" if learned else "s"),
        ):
            mine = sorted(
                (r for r in rows if r["temperature"] == temperature
                 and r["shape"].startswith("best:") == learned),
                key=lambda r: r["nodes"],
            )  # fmt: skip
            if not mine:
                continue
            nodes = [r["nodes"] for r in mine]
            left.plot(nodes, [r["tokens_per_call"] for r in mine], style, color=color,
                      label=f"{kind}, T = {temperature:g}")  # fmt: skip
            right.plot(nodes, [r["round_cost_vs_decode"] for r in mine], style, color=color,
                       label=f"round, {kind}, T = {temperature:g}")  # fmt: skip
    mine = sorted((r for r in rows if r["temperature"] == 0.0), key=lambda r: r["nodes"])
    right.plot([r["nodes"] for r in mine], [r["forward_cost_vs_decode"] for r in mine], "k^:",
               label="target forward alone")  # fmt: skip
    left.set(xlabel="tree nodes (4 = the chain, D = 4)", ylabel="tokens emitted per target call",
             title=f"{pair} pair, {draft} draft: tokens per target call")  # fmt: skip
    right.set(xlabel="tree nodes", ylabel="x one-token decode (same T)",
              title="cost of one tree call")  # fmt: skip
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
