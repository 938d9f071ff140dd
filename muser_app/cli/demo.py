"""`muser demo`: the README's first command.

Builds (or reuses) the fixtures, writes a throwaway cluster (keys, config) in a temporary
directory, qualifies its lane against plain decode (`muser qualify`: the verifier refuses
an unqualified lane), starts the verifier and the proposer daemons on loopback, streams a few
natural prompts with the text appearing as rounds commit, measures plain target decode on the
same prompts, prints a table, and shuts everything down — also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def _int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]; anything else is refused (exit 2) before
    the demo builds, qualifies or starts anything."""
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected  # what argparse names in its own messages
    return parse


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument(
        "--prompts", type=_int_in(1), default=3, help="natural prompts to stream (default 3)"
    )
    p.add_argument(
        "--max-tokens", type=_int_in(1), default=128, help="tokens per prompt (default 128)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft-len", type=_int_in(0, 64), default=4, help="drafts per round D (default 4)"
    )
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="write the cluster (keys, config, WALs, logs) here and keep it",
    )
    p.set_defaults(func=run)


def say(text: str) -> None:
    print(f"\n== {text}", file=sys.stderr, flush=True)


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse the sampling flags before any work: prompt i is sampled with seed + i."""
    from muser.sampling import SamplingParams

    for seed in (args.seed, args.seed + args.prompts - 1):
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=seed)


def run(args: argparse.Namespace) -> int:
    check_sampling(args)
    if args.keep is not None:
        return _demo(args, args.keep)
    with tempfile.TemporaryDirectory(prefix="muser-demo-") as tmp:
        return _demo(args, Path(tmp))


def _demo(args: argparse.Namespace, workdir: Path) -> int:
    from muser_app.cli._common import default_pair

    say("fixtures (built once, then cached)")
    target_dir, draft_dir = default_pair(progress=True)

    from transformers import AutoTokenizer

    from cluster_config import load_config
    from muser.affinity import pinned
    from muser.sampling import SamplingParams
    from muser_app.cli.cluster_client import stream_generate
    from muser_app.cli.config import init_cluster
    from muser_app.cli.qualify import qualify
    from muser_app.fixtures import natural_prompts
    from muser_app.lanes.plain import run_plain
    from muser_app.procs import Daemon
    from verifier_gx.backends import load_target_backend

    say(f"cluster: keys and cluster.toml in {workdir}")
    config = init_cluster(
        workdir, target=target_dir, draft=draft_dir, draft_len=args.draft_len, force=True
    )
    say(f"qualify: the lane against plain decode, then a signed receipt in {workdir}")
    receipt = qualify(load_config(config), progress=True)
    e = receipt.evidence
    print(
        f"qualified: {e.prompts} prompts x {e.tokens_per_prompt} greedy tokens identical, "
        f"acceptance {e.acceptance:.3f}",
        file=sys.stderr,
    )
    daemons = [Daemon("verifier", config, workdir), Daemon("proposer", config, workdir)]
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    rows = []
    try:
        for daemon in daemons:
            say(f"starting the {daemon.role} daemon (log: {daemon.log_path})")
            daemon.start()
        proposer = load_config(config).proposer
        target = load_target_backend("torch", target_dir)
        for i, text in enumerate(natural_prompts(args.prompts)):
            params = SamplingParams(
                temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i
            )
            prompt = list(tokenizer.encode(text, add_special_tokens=False))
            say(f"prompt {i + 1}/{args.prompts}: the cluster streams each round as it commits")
            sys.stdout.write(text)
            with pinned(proposer.cpus, "proposer.cpus"):  # the client, on the proposer's CPUs
                result = stream_generate(
                    proposer.address,
                    prompt,
                    params,
                    on_event=lambda e: (sys.stdout.write(e.text), sys.stdout.flush()),
                )
            target.reset()
            plain = run_plain(target, prompt, params)
            same = plain.tokens == result["tokens"]
            rows.append((result, plain, same))
            print()
    except KeyboardInterrupt:
        say("interrupted: stopping the daemons")
        return 130
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    _table(rows, args.temperature == 0)
    if args.temperature == 0 and not all(same for _, _, same in rows):
        print("ERROR: the cluster's greedy output differs from plain decode", file=sys.stderr)
        return 1
    return 0


def _table(rows, greedy: bool) -> None:
    from muser_app.cli._common import stats_table

    tokens = sum(len(r["tokens"]) for r, _, _ in rows)
    wall = sum(r["stats"]["client_wall_s"] for r, _, _ in rows)
    plain_tokens = sum(len(p.tokens) for _, p, _ in rows)
    plain_wall = sum(p.stats.wall_s for _, p, _ in rows)
    drafted = sum(r["stats"]["drafted"] for r, _, _ in rows)
    accepted = sum(r["stats"]["accepted"] for r, _, _ in rows)
    rounds = sum(r["stats"]["rounds"] for r, _, _ in rows)
    split = {
        k: sum(r["stats"]["split_s"][k] for r, _, _ in rows)
        for k in ("draft", "transport", "verify", "wal", "sign")
    }
    cluster_rate, plain_rate = tokens / wall, plain_tokens / plain_wall
    say("statistics")
    print(
        stats_table(
            [
                ("cluster (2 daemons, loopback)", f"{cluster_rate:.1f} tok/s"),
                ("plain target decode", f"{plain_rate:.1f} tok/s"),
                ("cluster / plain", f"{cluster_rate / plain_rate:.2f}×"),
                (
                    "acceptance",
                    f"{accepted / drafted:.3f} ({accepted}/{drafted})" if drafted else "-",
                ),
                ("tokens per round", f"{tokens / rounds:.2f} (includes the next frontier)"),
                ("round split", ", ".join(f"{k} {v:.2f}s" for k, v in split.items())),
                (
                    "exactness",
                    "greedy output identical to plain decode"
                    if greedy and all(s for _, _, s in rows)
                    else "sampled (same distribution)",
                ),
            ]
        )
    )
