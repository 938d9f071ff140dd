"""Soak a loopback cluster (issue 35): N sessions at bounded concurrency through real
daemons, both daemons' memory, file descriptors and threads sampled as sessions finish,
every session's tokens checked against its prompt's lone run. Writes a JSON receipt and
the memory curve as a PNG; exits 1 when a bound of `muser_app.bench.soak.verdict` broke or
a session differed.

    python scripts/soak.py --pair toy --sessions 1000 --concurrency 16 --every 25 \\
        --set limits.finished_sessions=256 \\
        --receipt docs/receipts/soak-toy-session26.json --png docs/soak-memory.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="toy", help="pair name (default toy)")
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts cycled through")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--every", type=int, default=20, help="sample every N finished sessions")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="a cluster file setting (TOML value), e.g. limits.max_batch=1; repeatable",
    )  # fmt: skip
    p.add_argument("--receipt", type=Path)
    p.add_argument("--png", type=Path)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from muser.sampling import SamplingParams
    from muser_app.bench.cluster import cluster_lanes
    from muser_app.bench.soak import plot, receipt, soak, verdict
    from muser_app.pairs import pair_prompts, resolve

    models = resolve(args.pair, None)
    tokenizer = AutoTokenizer.from_pretrained(str(models.target))
    prompts = [
        list(tokenizer.encode(t, add_special_tokens=False))
        for t in pair_prompts(models.pair, args.prompts, tokenizer)
    ]
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    with cluster_lanes(
        models.target, models.draft, params, draft_len=4, delays_ms=[0],
        draft_backend=models.draft_backend, pin=False,
        settings=dict(item.split("=", 1) for item in args.set),
    ) as lanes:  # fmt: skip
        lane = lanes["cluster@0ms"]
        pids = {role: d.proc.pid for role, d in lane.daemons.items()}

        def progress(point) -> None:
            rss = "  ".join(f"{r} {u.rss_mb:.0f} MB" for r, u in point.usage.items())
            print(f"{point.sessions:>6} sessions  {point.t_s:7.1f} s  {rss}", file=sys.stderr)

        started = time.time()
        points, mismatches = soak(
            lane, pids, prompts, sessions=args.sessions, concurrency=args.concurrency,
            max_tokens=args.max_tokens, every=args.every, progress=progress,
        )  # fmt: skip
    broken = verdict(points)
    meta = {
        "pair": models.pair, "draft_kind": models.draft_kind, "sessions": args.sessions,
        "concurrency": args.concurrency, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "seed": args.seed, "started": started,
        "wall_s": points[-1].t_s, "settings": args.set, "mismatches": mismatches,
        "broken": broken,
    }  # fmt: skip
    if args.receipt:
        args.receipt.write_text(json.dumps(receipt(points, meta), indent=1) + "\n")
    if args.png:
        title = (f"{args.sessions} sessions, {args.concurrency} at a time, {models.pair} pair, "
                 f"T={args.temperature:g}, {args.max_tokens} tokens each")  # fmt: skip
        plot(points, args.png, title)
    for line in mismatches + broken:
        print(line, file=sys.stderr)
    print(json.dumps({k: meta[k] for k in ("sessions", "wall_s", "mismatches", "broken")}))
    return 1 if mismatches or broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
