"""`muser bench`: lanes and peers on the fixture pair, with receipts; `--suite wal` for the WAL."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
from pathlib import Path

from muser.round import DEFAULT_Q_TOP_K


def _run_meta(args, pair, params, draft_range) -> dict:
    """What every suite's receipt says of its run: the command, the pair, the parameters."""
    return {
        "command": " ".join(sys.argv),
        "target": str(pair.target),
        "draft": str(pair.draft),
        "widen": {"target": args.widen_target, "draft": args.widen_draft},
        "params": vars(params) | {"stop_tokens": list(params.stop_tokens)},
        "draft_len": args.draft_len,
        "draft_range": list(draft_range) if draft_range else None,
        "tree_nodes": getattr(args, "tree_nodes", 0),
        "target_device": args.target_device,
        "max_tokens": args.max_tokens,
    }


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument(
        "--suite", choices=["lanes", "wal", "sessions"], default="lanes", help="default lanes"
    )
    p.add_argument(
        "--sessions",
        default="1,8",
        metavar="N,N",
        help="--suite sessions: concurrent sessions per run on one verifier (default 1,8)",
    )
    p.add_argument("--prompts", type=int, default=4, help="natural prompts (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per run (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per lane (default 3)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of every sampled run's MT19937 (default 0)"
    )
    p.add_argument("--draft-len", type=int, default=4, help="drafts per round D (default 4)")
    p.add_argument(
        "--draft-range",
        default=None,
        metavar="LO:HI",
        help="also run the local and cluster lanes with adaptive width in [LO, HI] "
        "(lanes local-adaptive, cluster@Xms-adaptive), beside the fixed --draft-len ones; "
        "--suite sessions: the sessions run adaptive in [LO, HI] instead of fixed",
    )
    p.add_argument(
        "--tree-nodes",
        type=int,
        default=0,
        metavar="N",
        help="also run the local tree lanes: trees of at most N nodes, --draft-len deep, in the "
        "budget's shape (local-tree) and learning size and shape (local-tree-adaptive; "
        "docs/trees.md); the cluster's tree lane is a variant, e.g. --cluster-variant "
        "'tree: lane.tree_nodes=N'",
    )
    p.add_argument(
        "--q-top-k",
        type=int,
        default=DEFAULT_Q_TOP_K,
        help=f"draft row width (default {DEFAULT_Q_TOP_K})",
    )
    from muser_app.cli._common import add_pair_args

    add_pair_args(p)
    p.add_argument(
        "--draft-backend",
        choices=["torch", "mlx"],
        default=None,
        help="a trained draft's backend (default torch; the n-gram draft has its own)",
    )
    p.add_argument(
        "--target-device",
        default="cpu",
        metavar="DEV",
        help="torch device of the target in the plain and local lanes and in the cluster's "
        "verifier (cpu, cuda, cuda:N; default cpu); the peers run on CPU and are skipped "
        "with a note when it is not cpu",
    )
    p.add_argument("--no-peers", action="store_true", help="skip the hf, mlx-lm, vLLM peers")
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        metavar="PATH",
        help="python of a vLLM environment for the vLLM speculative peer "
        "(default $MUSER_VLLM_PYTHON, else .venv-vllm/bin/python when present)",
    )
    p.add_argument(
        "--cluster-delays",
        default="0",
        metavar="MS,MS",
        help="cluster lanes at these injected round-trip delays in ms (default 0; '' = none)",
    )
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="let the OS place the cluster's daemons and client; default: each daemon on its "
        "own CPUs as `config init` writes them (proposer.cpus, verifier.cpus), each cluster "
        "run's client on the proposer's, as if on two machines",
    )
    p.add_argument(
        "--cluster-variant",
        action="append",
        default=[],
        metavar="'NAME: SECTION.KEY=VALUE ... [code=PATH]'",
        help="also run the cluster lanes on a second cluster with these settings, interleaved "
        "with the rest (lanes cluster@Xms[NAME]; --suite sessions: waves sessions=N[NAME], each "
        "beside the base cluster's, with their paired ratio ×base); VALUE is TOML without "
        "spaces, or none to "
        "remove the key, e.g. 'b2: lane.speculate_branches=2' or 'nopin: proposer.cpus=none "
        "verifier.cpus=none'; code=PATH runs the variant's daemons from the checkout at PATH "
        "(an A/B of two trees' code, e.g. 'old: code=../muser-old'); repeatable",
    )
    p.add_argument(
        "--qualify-tolerance",
        type=float,
        default=None,
        metavar="X",
        help="the row tolerance each cluster's qualification allows (as --tolerance of "
        "`muser qualify`; default its own, 1e-4)",
    )
    p.add_argument(
        "--variants-only",
        action="store_true",
        help="run the cluster lanes of the --cluster-variant clusters only, not the base "
        "cluster's (e.g. when only variants that lower lane.acceptance_floor qualify)",
    )
    p.add_argument("--periodic", action="store_true", help="the periodic control (labelled)")
    p.add_argument(
        "--widen-target",
        type=int,
        default=1,
        metavar="F",
        help="run every lane and peer on the fixture target widened F times: the same logits "
        "at about F*F times the arithmetic a forward, a stand-in for a target whose forward "
        "dwarfs a round's fixed costs (muser_app/fixtures/widen.py; default 1, the fixture itself)",
    )
    p.add_argument(
        "--widen-draft",
        type=int,
        default=1,
        metavar="F",
        help="the same for the draft (default 1); equal factors keep the pair's cost ratio",
    )
    p.add_argument(
        "--receipt", type=Path, default=None, help="receipt path (default bench-receipts/)"
    )
    p.add_argument("--wal-dir", type=Path, default=None, help="directory for --suite wal")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.cluster_variant and args.suite == "wal":
        from muser.errors import RefusedError

        raise RefusedError(
            "--cluster-variant runs beside the cluster lanes of --suite lanes or sessions; "
            "--suite wal has none to compare with"
        )
    if args.suite == "wal":
        return _run_wal(args)
    _check_counts(args)
    from muser_torch.backend import check_device

    args.target_device = check_device(args.target_device, "--target-device")  # before any work
    with _sigterm_interrupts():
        if args.suite == "sessions":
            return _run_sessions(args)
        return _run_lanes(args)


def _check_counts(args: argparse.Namespace) -> None:
    """Refuse (exit 2) a count, delay or sampling setting the suite cannot run, before any
    fixture is built or daemon started; the message names the flag and what it got."""
    from muser.errors import RefusedError
    from muser.sampling import SamplingParams

    least = {"--max-tokens": (args.max_tokens, 1), "--repeats": (args.repeats, 1)}
    least |= {"--draft-len": (args.draft_len, 0), "--q-top-k": (args.q_top_k, 1)}
    least |= {"--tree-nodes": (args.tree_nodes, 0)}
    tolerance = getattr(args, "qualify_tolerance", None)
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise RefusedError(f"--qualify-tolerance must be a finite number >= 0, got {tolerance}")
    if args.tree_nodes > 64:
        raise RefusedError(f"--tree-nodes must be <= 64 (lane.tree_nodes), got {args.tree_nodes}")
    least |= {"--widen-target": (args.widen_target, 1), "--widen-draft": (args.widen_draft, 1)}
    if args.suite == "lanes":
        least["--prompts"] = (args.prompts, 1)
    for flag, (value, low) in least.items():
        if value < low:
            raise RefusedError(f"{flag} must be >= {low}, got {value}")
    SamplingParams(temperature=args.temperature, seed=args.seed)  # refuses a bad one by name
    args.cluster_delays = _delays(args.cluster_delays) if args.suite == "lanes" else [0.0]
    if args.suite == "sessions":
        args.sessions = _session_counts(args.sessions)


def _delays(text: str) -> list[float]:
    """--cluster-delays MS,MS as milliseconds ('' = no cluster lanes)."""
    import math

    from muser.errors import RefusedError

    delays = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            ms = float(part)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms >= 0):
            raise RefusedError(
                f"--cluster-delays: expected milliseconds >= 0 separated by commas "
                f"(e.g. 0,5,20; '' for none), got {part!r} in {text!r}"
            )
        delays.append(ms)
    return delays


def _session_counts(text: str) -> list[int]:
    """--sessions N,N as distinct counts, ascending."""
    from muser.errors import RefusedError

    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise RefusedError(
            f"--sessions: expected counts >= 1 separated by commas, e.g. 1,8; got {text!r}"
        )
    return sorted({int(p) for p in parts})


INTERRUPTED = 130
"""The exit code of a bench stopped by Ctrl-C or SIGTERM (after it kept what it had)."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM (a `timeout`, a supervisor) stops a bench as Ctrl-C does: the runs done so
    far are summarised and kept in a receipt marked `interrupted`, and the bench's daemons
    are stopped on the way out."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(done: int, planned: int) -> str | None:
    """The receipt's `interrupted` field: None for a complete run."""
    return None if done >= planned else f"stopped after {done} of {planned} runs"


def _run_lanes(args: argparse.Namespace) -> int:
    import time

    from transformers import AutoTokenizer

    from muser.errors import RefusedError
    from muser.sampling import SamplingParams
    from muser_app.bench.lanes import build_lanes
    from muser_app.bench.run import format_table, run_bench, summarise, write_receipt
    from muser_app.cli._common import encode_prompt
    from muser_app.fixtures import build_fixtures, periodic_prompt
    from muser_app.pairs import pair_prompts

    delays = args.cluster_delays  # milliseconds (_check_counts)
    variants = _variants(args.cluster_variant, delays)
    if args.variants_only and not variants:
        raise RefusedError("--variants-only runs the --cluster-variant clusters: give one")
    if args.periodic:
        pair, name = _widened(build_fixtures(progress=not args.json).periodic, args), "toy"
        args.draft_backend = args.draft_backend or "torch"
    else:
        pair, name = _pair(args)
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    texts = (
        [periodic_prompt()] * args.prompts
        if args.periodic
        else pair_prompts(name, args.prompts, tokenizer)
    )
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    draft_range = _draft_range(args)
    lanes, notes = build_lanes(
        pair.target,
        pair.draft,
        params,
        draft_len=args.draft_len,
        q_top_k=args.q_top_k,
        draft_backend=args.draft_backend,
        peers=not args.no_peers,
        vllm_python=args.vllm_python,
        draft_range=draft_range,
        target_device=args.target_device,
        tree_nodes=args.tree_nodes,
    )
    from muser_app.bench.cluster import cluster_lanes

    with contextlib.ExitStack() as stack:
        base = [(None, None)] if delays and not args.variants_only else []
        for variant, settings in base + list(variants.items()):
            got = stack.enter_context(
                cluster_lanes(
                    pair.target,
                    pair.draft,
                    params,
                    draft_len=args.draft_len,
                    draft_backend=args.draft_backend,
                    delays_ms=delays,
                    draft_range=draft_range,
                    target_device=args.target_device,
                    pin=not args.no_pin,
                    settings=settings,
                    tolerance=args.qualify_tolerance,
                )
            )
            lanes |= {(f"{k}[{variant}]" if variant else k): fn for k, fn in got.items()}
        samples = run_bench(lanes, prompts, args.max_tokens, args.repeats, progress=not args.json)
    interrupted = _interrupted(len(samples), args.repeats * len(prompts) * len(lanes))
    if not samples:
        print("muser bench: interrupted before any run finished; no receipt", file=sys.stderr)
        return INTERRUPTED
    rtt = {k: fn.rtt_s for k, fn in lanes.items() if hasattr(fn, "rtt_s")}
    summary = summarise(samples, rtt, _cores(lanes), sampled=args.temperature > 0)
    meta = {
        **_run_meta(args, pair, params, draft_range),
        "pair": name,
        "draft_kind": getattr(args, "draft_kind_used", None),
        "fixture": "periodic (control)" if args.periodic else "natural",
        "q_top_k": args.q_top_k,
        "draft_backend": args.draft_backend,
        "cluster_delays_ms": delays,
        "cluster_variants": variants,
        "repeats": args.repeats,
        "interrupted": interrupted,
        "notes": notes,
        "threads": "torch.set_num_threads(1); mlx on its CPU stream",
        "cpus": _cpus(lanes),
    }
    receipt = (
        args.receipt or Path("bench-receipts") / f"lanes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    digest = write_receipt(receipt, meta, samples, summary)
    code = INTERRUPTED if interrupted else 0
    if args.json:
        out = {"summary": summary, "receipt": str(receipt), "sha256": digest, "notes": notes}
        print(json.dumps(out | {"interrupted": interrupted}))
        return code
    if args.periodic:
        print("CONTROL (periodic fixture): calibrates the harness, never quoted as a result")
    if widened := _widened_label(args):
        print(widened)
    print(format_table(summary))
    for lane, note in notes.items():
        print(f"note: {lane}: {note}")
    if interrupted:
        print(f"INTERRUPTED: {interrupted}; the table and receipt hold only those")
    print(f"receipt: {receipt} (samples sha256 {digest})")
    return code


def _variants(texts: list[str], delays: list[float]) -> dict[str, dict[str, str]]:
    """--cluster-variant values as {name: settings}; refused (exit 2) before any work."""
    from muser.errors import RefusedError
    from muser_app.bench.cluster import parse_variant

    variants: dict[str, dict[str, str]] = {}
    for text in texts:
        try:
            name, settings = parse_variant(text)
        except ValueError as exc:
            raise RefusedError(str(exc)) from None
        if name in variants:
            raise RefusedError(f"--cluster-variant: the name {name!r} is given twice")
        variants[name] = settings
    if variants and not delays:
        raise RefusedError("--cluster-variant runs cluster lanes: give --cluster-delays too")
    return variants


def _cpus(lanes: dict) -> dict:
    """Where the cluster ran, for the receipt: each daemon's CPUs (None: placed by the OS),
    and the harness's own as the client of a cluster run (the proposer's when pinned)."""
    cpus = next((fn.cpus for fn in lanes.values() if getattr(fn, "cpus", None)), {})
    if not cpus:
        return {}
    return cpus | {"client": cpus.get("proposer") or "placed by the OS"}


def _cores(lanes: dict) -> dict[str, dict[str, int]]:
    """{lane: {role: CPUs}} for each lane whose every daemon is pinned (`cpus` set)."""
    out = {}
    for name, fn in lanes.items():
        cpus = getattr(fn, "cpus", None) or {}
        if cpus and all(cpus.values()):
            out[name] = {role: len(c) for role, c in cpus.items()}
    return out


def _pair(args: argparse.Namespace):
    """The pair the flags name (--pair, --draft-kind, --target/--draft), widened as asked;
    sets args.draft_backend to what the draft kind runs on."""
    from muser_app.cli._common import pair_models
    from muser_app.fixtures import FixturePair

    models = pair_models(args, progress=not args.json)
    args.draft_backend = models.draft_backend or args.draft_backend or "torch"
    args.draft_kind_used = models.draft_kind
    return _widened(FixturePair(models.target, models.draft), args), models.pair


def _widened(pair, args: argparse.Namespace):
    """The pair with each model widened as --widen-target and --widen-draft say (1: as built)."""
    from muser_app.fixtures import FixturePair
    from muser_app.fixtures.widen import widen

    return FixturePair(widen(pair.target, args.widen_target), widen(pair.draft, args.widen_draft))


def _widened_label(args: argparse.Namespace) -> str | None:
    """The line above the table of a run on widened models (None: the pair as built)."""
    if (args.widen_target, args.widen_draft) == (1, 1):
        return None
    return (
        f"WIDENED PAIR: target x{args.widen_target}, draft x{args.widen_draft} (the same "
        "logits, heavier forwards: docs/fixtures.md, 'Widened stand-ins')"
    )


def _draft_range(args: argparse.Namespace) -> tuple[int, int] | None:
    from muser_app.cli._common import parse_draft_range

    return None if args.draft_range is None else parse_draft_range(args.draft_range, args.draft_len)


def _run_wal(args: argparse.Namespace) -> int:
    import tempfile

    from wal.bench import format_wal_bench, run_wal_bench

    with tempfile.TemporaryDirectory(dir=args.wal_dir) as tmp:
        result = run_wal_bench(Path(tmp), progress=not args.json)
    print(json.dumps(result) if args.json else format_wal_bench(result))
    return 0


def _run_sessions(args: argparse.Namespace) -> int:
    import time

    from transformers import AutoTokenizer

    from muser.sampling import SamplingParams
    from muser_app.bench.cluster import cluster_lanes
    from muser_app.bench.run import write_receipt
    from muser_app.bench.sessions import (
        format_sessions,
        oracle_tokens,
        run_sessions_bench,
        summarise_sessions,
    )
    from muser_app.cli._common import encode_prompt
    from muser_app.pairs import pair_prompts

    sessions = args.sessions  # distinct counts, ascending (_check_counts)
    variants = _variants(args.cluster_variant, [0.0])
    pair, name = _pair(args)
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    prompts = [encode_prompt(tokenizer, t) for t in pair_prompts(name, max(sessions), tokenizer)]
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    oracle = None
    if params.greedy:
        oracle = oracle_tokens(pair.target, prompts, params, args.max_tokens, args.target_device)
    draft_range = _draft_range(args)
    lane = "cluster@0ms-adaptive" if draft_range else "cluster@0ms"
    with contextlib.ExitStack() as stack:
        clusters = {
            name: stack.enter_context(
                cluster_lanes(
                    pair.target,
                    pair.draft,
                    params,
                    draft_len=args.draft_len,
                    delays_ms=[0.0],
                    draft_range=draft_range,
                    target_device=args.target_device,
                    pin=not args.no_pin,
                    settings=settings,
                    tolerance=args.qualify_tolerance,
                )
            )[lane]
            for name, settings in {"": None, **variants}.items()
        }
        cpus = _cpus({"": clusters[""]})
        cores = _cores(clusters)  # {variant: {daemon: CPUs}}, for each pinned cluster
        samples, rates = run_sessions_bench(
            clusters.pop(""),
            prompts,
            sessions,
            args.max_tokens,
            args.repeats,
            progress=not args.json,
            variants=clusters,
        )
    planned = args.repeats * len(sessions) * (1 + len(variants))
    interrupted = _interrupted(sum(map(len, rates.values())), planned)
    if not rates:
        print("muser bench: interrupted before any run finished; no receipt", file=sys.stderr)
        return INTERRUPTED
    summary = summarise_sessions(rates, samples, oracle, cores)
    meta = {
        **_run_meta(args, pair, params, draft_range),
        "suite": "sessions",
        "fixture": "natural",
        "sessions": sessions,
        "repeats": args.repeats,
        "interrupted": interrupted,
        "rates_tokens_per_s": rates,
        "cluster_variants": variants,
        "threads": "torch.set_num_threads(1) in each daemon",
        "cpus": cpus,
    }
    receipt = (
        args.receipt or Path("bench-receipts") / f"sessions-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    digest = write_receipt(receipt, meta, samples, summary)
    code = INTERRUPTED if interrupted else 0
    if args.json:
        out = {"summary": summary, "receipt": str(receipt), "sha256": digest}
        print(json.dumps(out | {"interrupted": interrupted}))
        return code
    if widened := _widened_label(args):
        print(widened)
    print(format_sessions(summary))
    if interrupted:
        print(f"INTERRUPTED: {interrupted}; the table and receipt hold only those")
    print(f"receipt: {receipt} (samples sha256 {digest})")
    return code
