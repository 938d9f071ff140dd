"""The benchmark harness (DESIGN.md §9): lanes and peers on the same pair and prompts.

Discipline: every lane runs on every prompt in one process, lanes interleaved within each
repeat (so drift hits all of them alike), the median and spread over repeats reported, and
every raw sample kept in a receipt whose SHA-256 covers the samples' canonical JSON.
Threads: torch runs with one intra-op thread (tiny models are faster that way on the
2-core box, and it keeps the second core free for the OS and the harness); MLX runs on its
CPU stream. The cluster's daemons run on the CPUs `config init` gives each (half the
machine's each), and the harness is the client of a cluster run on the proposer's
(`muser.bench_cluster`, `--no-pin` to let the OS place them). The vLLM peer is the
exception to "one process": vLLM lives in its own environment, so it runs in a child process
(`muser.vllm_peer`) that serves one run per request, keeping the warm-up and the interleaved
order; its child also uses one torch thread. Ratios are to plain target decode measured in
the same run.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from muser.sampling import SamplingParams
from muser.width import AdaptiveWidth, WidthPolicy


@dataclass
class Sample:
    lane: str
    prompt: int
    repeat: int
    tokens: list[int]
    wall_s: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    split_s: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds the run cost, per process: the bench's own for our in-process lanes
    ("lane"), each daemon's for the cluster ("proposer", "verifier"); empty where unmeasured."""

    def to_dict(self) -> dict:
        return self.__dict__.copy()


LaneFn = Callable[[list[int], int], Sample]


def _ours(
    kind: str,
    target,
    draft,
    params: SamplingParams,
    draft_len: int,
    q_top_k: int,
    width: Callable[[], WidthPolicy] | None = None,
) -> LaneFn:
    """Our plain or local lane; `width` makes each run's width policy (default: fixed D)."""
    from proposer_mac.local_lane import run_local
    from verifier_gx.plain import run_plain

    def run(prompt: list[int], max_tokens: int) -> Sample:
        p = replace(params, max_tokens=max_tokens)
        target.reset()
        cpu = time.process_time()  # this process, every thread: the lane runs alone in it
        if kind == "plain":
            r = run_plain(target, prompt, p)
        else:
            draft.reset()
            policy = width() if width is not None else None
            r = run_local(
                target, draft, prompt, p, draft_len=draft_len, q_top_k=q_top_k, width=policy
            )
        s = r.stats
        return Sample(
            kind,
            0,
            0,
            r.tokens,
            s.wall_s,
            s.drafted,
            s.accepted,
            s.rounds,
            {"draft": s.draft_s, "verify": s.verify_s},
            {"lane": time.process_time() - cpu},
        )

    return run


def _transformers_assisted(target_dir: Path, draft_dir: Path, draft_len: int) -> LaneFn:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    assistant.generation_config.num_assistant_tokens = draft_len
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0

    def run(prompt: list[int], max_tokens: int) -> Sample:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=assistant,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        wall = time.perf_counter() - start
        return Sample("hf-assisted", 0, 0, out[0, len(prompt) :].tolist(), wall)

    return run


def _mlx_speculative(target_dir: Path, draft_dir: Path, draft_len: int) -> LaneFn:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import speculative_generate_step

    model, _ = load(str(target_dir))
    draft_model, _ = load(str(draft_dir))

    def run(prompt: list[int], max_tokens: int) -> Sample:
        tokens: list[int] = []
        accepted = 0
        start = time.perf_counter()
        steps = speculative_generate_step(
            mx.array(prompt),
            model,
            draft_model,
            num_draft_tokens=draft_len,
            max_tokens=max_tokens,
        )
        for token, _, from_draft in steps:
            tokens.append(int(token))
            accepted += bool(from_draft)
            if len(tokens) >= max_tokens:
                break
        wall = time.perf_counter() - start
        return Sample("mlx-lm-speculative", 0, 0, tokens, wall, accepted=accepted)

    return run


def vllm_speculative_lane(
    python: Path | None, target_dir: Path, draft_dir: Path, draft_len: int
) -> tuple[LaneFn | None, str]:
    """vLLM's draft-model speculative decoding in a child process under `python` (a vLLM
    environment's interpreter; None when there is none), and its note: why it was skipped,
    or what it cost to start (engine start is never in its tokens/s)."""
    import atexit

    from muser.vllm_peer import ENV_PYTHON, VllmPeerError, VllmSpeculativePeer, vllm_distribution

    if python is None:
        return None, (
            f"skipped: no vLLM python (no --vllm-python, ${ENV_PYTHON} unset, and no "
            ".venv-vllm/bin/python; `make vllm-env` builds one)"
        )
    if not python.exists():
        return None, f"skipped: the vLLM python {python} does not exist"
    dist = vllm_distribution(python)
    if dist is None:
        return None, f"skipped: {python} runs no Python with a vLLM distribution installed"
    try:
        peer = VllmSpeculativePeer(python, target_dir, draft_dir, draft_len)
    except VllmPeerError as exc:
        return None, f"skipped: {dist} under {python} could not run speculative decoding: {exc}"
    atexit.register(peer.close)
    info = peer.info
    return peer, (
        f"ran in a child process under {python} ({info['vllm']}, draft_model method, "
        f"{draft_len} speculative tokens, {info['threads']} torch thread(s), prefix cache off); "
        f"engine start {info['import_s'] + info['engine_s']:.1f} s (import "
        f"{info['import_s']:.1f} s + engine {info['engine_s']:.1f} s), not in tokens/s, which "
        "the child times around LLM.generate"
    )


def build_lanes(
    target_dir: Path,
    draft_dir: Path,
    params: SamplingParams,
    *,
    draft_len: int,
    q_top_k: int,
    draft_backend: str,
    peers: bool,
    vllm_python: Path | None = None,
    draft_range: tuple[int, int] | None = None,
    decode_len: int = 8,
    target_device: str = "cpu",
) -> tuple[dict[str, LaneFn], dict[str, str]]:
    """The lanes to run, and a note per lane that could not be built (never silent) or whose
    set-up cost is kept out of its samples. `vllm_python`: the vLLM peer's interpreter
    (default: `muser.vllm_peer.default_vllm_python`). `draft_range`: add `local-adaptive`,
    the local lane with `AdaptiveWidth` in that range (draftless rounds decode `decode_len`).
    `target_device`: where the plain and local lanes run the target (the peers run on CPU,
    so they are skipped, with a note, on any other device)."""
    from muser.vllm_peer import PEER, default_vllm_python
    from proposer_mac.backends import load_draft_backend
    from verifier_gx.backends import load_target_backend

    target = load_target_backend("torch", target_dir, device=target_device)
    draft = load_draft_backend(draft_backend, draft_dir)
    lanes: dict[str, LaneFn] = {
        "plain": _ours("plain", target, None, params, draft_len, q_top_k),
        "local": _ours("local", target, draft, params, draft_len, q_top_k),
    }
    if draft_range is not None:  # the adaptive width beside the fixed one, same prompts
        lo, hi = draft_range
        lanes["local-adaptive"] = _ours(
            "local",
            target,
            draft,
            params,
            draft_len,
            q_top_k,
            lambda: AdaptiveWidth(draft_len, lo, hi, decode_len),
        )
    notes: dict[str, str] = {}
    if peers and target_device != "cpu":
        notes["peers"] = f"peers run the target on CPU; skipped with the target on {target_device}"
    elif peers and params.greedy:
        lanes["hf-assisted"] = _transformers_assisted(target_dir, draft_dir, draft_len)
        lanes["mlx-lm-speculative"] = _mlx_speculative(target_dir, draft_dir, draft_len)
        python = default_vllm_python(vllm_python)
        lane, notes[PEER] = vllm_speculative_lane(python, target_dir, draft_dir, draft_len)
        if lane is not None:
            lanes[PEER] = lane
    elif peers:
        notes["peers"] = "peers run greedy only in this version; skipped at T > 0"
    return lanes, notes


def run_bench(
    lanes: dict[str, LaneFn],
    prompts: list[list[int]],
    max_tokens: int,
    repeats: int,
    progress: bool = True,
) -> list[Sample]:
    """Every run's sample; fewer than repeats × prompts × lanes when interrupted (Ctrl-C, or
    SIGTERM under `muser bench`): the runs done are kept, the one under way is dropped."""
    from tqdm import tqdm

    for fn in lanes.values():  # warm-up: first-call allocation and lazy init stay out of samples
        fn(prompts[0][:8], 4)
    samples: list[Sample] = []
    total = repeats * len(prompts) * len(lanes)
    with tqdm(total=total, desc="bench", disable=not progress, unit="run") as bar:
        try:
            for repeat in range(repeats):
                for i, prompt in enumerate(prompts):
                    order = list(lanes) if (repeat + i) % 2 == 0 else list(reversed(lanes))
                    for name in order:
                        s = lanes[name](prompt, max_tokens)
                        s.lane, s.prompt, s.repeat = name, i, repeat
                        samples.append(s)
                        bar.update()
        except KeyboardInterrupt:
            bar.write(f"bench: interrupted after {len(samples)} of {total} runs")
    return samples


def expected_tokens(acceptance: float, depth: float) -> float:
    """Tokens per round of D drafts each accepted with probability α independently (the
    standard speculative-decoding estimate): (1 − α^(D+1)) / (1 − α); D + 1 when α = 1."""
    if acceptance >= 1.0:
        return depth + 1.0
    return (1.0 - acceptance ** (depth + 1.0)) / (1.0 - acceptance)


def _predicted(row: dict, drafted: int, rounds: int) -> float | None:
    """The lane's tokens/s predicted from its measured acceptance and its measured draft and
    verify compute per round (every other cost gone). None without drafts, without a
    measured draft and verify split, or when rounds emitted more than D + 1 tokens (decode
    rounds: the estimate does not describe them)."""
    split, acceptance = row["split_s"], row["acceptance"]
    if not drafted or not rounds or acceptance is None or "draft" not in split:
        return None
    depth = drafted / rounds
    if row["tokens_per_round"] > depth + 1.0 + 1e-9 or not split.get("verify"):
        return None
    return expected_tokens(acceptance, depth) / ((split["draft"] + split["verify"]) / rounds)


def _wire_bounds(emitted: int, rounds: int, split: dict[str, float], rtt: float) -> dict:
    """What no lane can beat whose round's request leaves only once the round before it
    returned, with this lane's tokens per round over a round trip of `rtt` seconds: one
    round trip a round (`wire_bound`: the draft, the protocol and even the target's forward
    free, as a lookahead that hides the forward in the wire would make it), and one round
    trip plus the round's measured verifier compute (`wire_serial_bound`: the target starts
    when the request arrives). {} without an injected round trip or without rounds."""
    if rtt <= 0 or not rounds:
        return {}
    verify = split.get("verify")
    return {
        "rtt_ms": 1e3 * rtt,
        "wire_bound_tokens_per_s": emitted / (rounds * rtt),
        "wire_serial_bound_tokens_per_s": emitted / (rounds * rtt + verify) if verify else None,
    }


def core_bound(cpu_ms: dict[str, float], tokens_per_round: float | None,
               cores: dict[str, int]) -> dict:  # fmt: skip
    """A lane whose processes are each confined to `cores[role]` CPUs spends, per round,
    at least its busiest process's CPU ms a round (`cpu_ms[role]`) divided by that process's
    CPUs: no round is shorter (with concurrent sessions, no session-round on average), so no
    run beats `tokens_per_round` over that (`core_bound_tokens_per_s`). {} unless every
    measured process has a known CPU count."""
    if not cpu_ms or not tokens_per_round or any(not cores.get(r) for r in cpu_ms):
        return {}
    role = max(cpu_ms, key=lambda r: cpu_ms[r] / cores[r])
    busiest = cpu_ms[role] / cores[role]
    return {
        "busiest_core": role,
        "busiest_core_ms_per_round": busiest,
        "core_bound_tokens_per_s": 1e3 * tokens_per_round / busiest,
    }


def core_bound_note(row: dict, ratio: float, against: str) -> str:
    """The CPU line's ending for a row with a `core_bound`: "(busiest core, ROLE: ≤ RATE
    tok/s, RATIO×AGAINST)"."""
    return (
        f"  (busiest core, {row['busiest_core']}: ≤ {row['core_bound_tokens_per_s']:.1f} tok/s, "
        f"{ratio:.2f}×{against})"
    )


def _overhead_ms(samples: list[Sample]) -> float | None:
    """Median over runs of (wall − draft − verify compute) / rounds, in ms: what a round
    costs besides its two computes (transport, WAL, signatures, Python, waiting). None for
    lanes without a draft and verify split (plain decode, the peers)."""
    per_run = [
        1e3 * (s.wall_s - s.split_s["draft"] - s.split_s["verify"]) / s.rounds
        for s in samples
        if s.rounds and "draft" in s.split_s and "verify" in s.split_s and s.drafted
    ]
    return statistics.median(per_run) if per_run else None


def _cpu_ms(samples: list[Sample], rounds: int) -> dict[str, float]:
    """CPU ms per round of each process measured in every run of the lane (summed over the
    runs, divided by their rounds); {} when a run lacks one or there are no rounds."""
    roles = set.intersection(*(set(s.cpu_s) for s in samples)) if samples else set()
    if not rounds:
        return {}
    return {r: 1e3 * sum(s.cpu_s[r] for s in samples) / rounds for r in sorted(roles)}


def summarise(
    samples: list[Sample],
    rtt_s: dict[str, float] | None = None,
    cores: dict[str, dict[str, int]] | None = None,
    *,
    sampled: bool = False,
) -> dict[str, dict]:
    """Per lane: median tokens/s over repeats (of the per-repeat aggregate), spread, ratio;
    the verifier-only ceiling, the ideal (measured compute only) and the speedup over plain
    predicted from measured acceptance and compute (`expected_tokens`). `rtt_s`: the round
    trip injected under a lane ({lane: seconds}); such a lane also gets its wire bounds
    (`_wire_bounds`). `cores`: how many CPUs each of a lane's processes is confined to
    ({lane: {role: n}}); such a lane also gets its core bound (`core_bound`).

    Exactness, per lane, as "equal/runs": greedy, each run's tokens against plain decode's
    of the same prompt and repeat (`greedy_match_plain`); `sampled` (T > 0), the local and
    cluster lanes' against the local lane's (`sampled_match_local`: the same seed and round
    protocol give the same tokens where the widths drafted are the same), nothing for plain
    decode or the peers, which sample with their own draws."""
    by_lane: dict[str, dict[int, list[Sample]]] = {}
    for s in samples:
        by_lane.setdefault(s.lane, {}).setdefault(s.repeat, []).append(s)
    out: dict[str, dict] = {}
    for lane, repeats in by_lane.items():
        rates = [
            sum(len(s.tokens) for s in ss) / sum(s.wall_s for s in ss) for ss in repeats.values()
        ]
        all_s = [s for ss in repeats.values() for s in ss]
        drafted = sum(s.drafted for s in all_s)
        accepted = sum(s.accepted for s in all_s)
        rounds = sum(s.rounds for s in all_s)
        emitted = sum(len(s.tokens) for s in all_s)
        split: dict[str, float] = {}
        for smp in all_s:
            for k, v in smp.split_s.items():
                split[k] = split.get(k, 0.0) + v
        out[lane] = {
            "split_s": split,
            "verifier_ceiling": emitted / split["verify"] if split.get("verify") else None,
            "ideal_tokens_per_s": (
                emitted / (split["draft"] + split["verify"])
                if split.get("verify") and "draft" in split
                else None
            ),
            "tokens_per_s": statistics.median(rates),
            "spread": [min(rates), max(rates)],
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": emitted / rounds if rounds else None,
        }
        out[lane]["predicted_tokens_per_s"] = _predicted(out[lane], drafted, rounds)
        out[lane]["overhead_ms_per_round"] = _overhead_ms(all_s)
        out[lane]["cpu_ms_per_round"] = _cpu_ms(all_s, rounds)
        out[lane] |= _wire_bounds(emitted, rounds, split, (rtt_s or {}).get(lane, 0.0))
        row = out[lane]
        row |= core_bound(
            row["cpu_ms_per_round"], row["tokens_per_round"], (cores or {}).get(lane, {})
        )
    plain_compute = out.get("plain", {}).get("verifier_ceiling")  # plain decode's compute rate
    for row in out.values():
        predicted = row["predicted_tokens_per_s"]
        row["predicted_speedup"] = (
            predicted / plain_compute if predicted and plain_compute else None
        )
    if "plain" in out:
        base = out["plain"]["tokens_per_s"]
        for row in out.values():
            row["ratio_to_plain"] = row["tokens_per_s"] / base
            for key in ("wire_bound", "wire_serial_bound"):
                if row.get(f"{key}_tokens_per_s"):
                    row[f"{key}_ratio_to_plain"] = row[f"{key}_tokens_per_s"] / base
    if "local" in out:
        base = out["local"]["tokens_per_s"]
        for row in out.values():
            row["ratio_to_local"] = row["tokens_per_s"] / base
            if row.get("core_bound_tokens_per_s"):
                row["core_bound_ratio_to_local"] = row["core_bound_tokens_per_s"] / base
    reference, key = (
        ("local", "sampled_match_local") if sampled else ("plain", "greedy_match_plain")
    )
    expected = {(s.prompt, s.repeat): s.tokens for s in samples if s.lane == reference}
    for lane in out:
        if sampled and not (lane == "local" or lane.startswith("cluster@")):
            continue
        same = [s.tokens == expected.get((s.prompt, s.repeat)) for s in samples if s.lane == lane]
        out[lane][key] = f"{sum(same)}/{len(same)}"
    return out


def write_receipt(path: Path, meta: dict, samples: list[Sample], summary: dict) -> str:
    raw = json.dumps([s.to_dict() for s in samples], sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(raw.encode()).hexdigest()
    receipt = {
        "meta": {**meta, "python": platform.python_version(), "machine": platform.machine()},
        "summary": summary,
        "samples_sha256": digest,
        "samples": json.loads(raw),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(receipt, indent=1))
    return digest


def format_table(summary: dict) -> str:
    head = (
        f"{'lane':<20} {'tok/s':>8} {'spread':>13} {'×plain':>7} {'×local':>7} {'accept':>7} "
        f"{'tok/rnd':>7} {'ceiling':>8} {'×ceil':>6} {'ideal':>7} {'pred×':>6} {'ovh ms':>6} "
        f"{'wire×pl':>9} {'exact':>7}"
    )
    lines = [head]
    sampled = any("sampled_match_local" in r for r in summary.values())
    for lane, r in summary.items():
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] is not None else "-"
        ceiling = r.get("verifier_ceiling")
        ceil_s = f"{ceiling:.1f}" if ceiling else "-"
        ratio = f"{r['tokens_per_s'] / ceiling:.2f}" if ceiling else "-"
        to_local = f"{r['ratio_to_local']:.2f}" if "ratio_to_local" in r else "-"
        ideal = f"{r['ideal_tokens_per_s']:.1f}" if r.get("ideal_tokens_per_s") else "-"
        pred = f"{r['predicted_speedup']:.2f}" if r.get("predicted_speedup") else "-"
        ovh = r.get("overhead_ms_per_round")
        ovh_s = f"{ovh:.2f}" if ovh is not None else "-"
        lo, hi = r["spread"]
        wire, serial = r.get("wire_bound_ratio_to_plain"), r.get("wire_serial_bound_ratio_to_plain")
        wire = "-" if not wire else f"{wire:.2f}/{serial:.2f}" if serial else f"{wire:.2f}"
        lines.append(
            f"{lane:<20} {r['tokens_per_s']:>8.1f} {f'{lo:.1f}–{hi:.1f}':>13} "
            f"{r.get('ratio_to_plain', 0):>7.2f} {to_local:>7} {acc:>7} {tpr:>7} {ceil_s:>8} "
            f"{ratio:>6} {ideal:>7} {pred:>6} {ovh_s:>6} {wire:>9} "
            f"{r.get('sampled_match_local' if sampled else 'greedy_match_plain', '-'):>7}"
        )
    lines.append(
        "exact: runs whose tokens equal the local lane's, same seed (T > 0: plain decode and "
        "the peers draw their own samples)"
        if sampled
        else "exact: runs whose tokens equal plain decode's"
    )
    splits = [(lane, r["split_s"]) for lane, r in summary.items() if r.get("split_s")]
    if splits:
        lines.append("round split (seconds summed over all runs):")
        for lane, split in splits:
            lines.append(f"  {lane:<18} " + "  ".join(f"{k} {v:.3f}" for k, v in split.items()))
    cpus = [
        (lane, r["cpu_ms_per_round"]) for lane, r in summary.items() if r.get("cpu_ms_per_round")
    ]
    if cpus:
        lines.append("CPU per round, ms (per process; the cluster's daemons, our lanes' own):")
        for lane, cpu in cpus:
            total = f"  total {sum(cpu.values()):.2f}" if len(cpu) > 1 else ""
            row = summary[lane]
            ratio = row.get("core_bound_ratio_to_local")
            bound = core_bound_note(row, ratio, " local") if ratio else ""
            lines.append(
                f"  {lane:<18} " + "  ".join(f"{k} {v:.2f}" for k, v in cpu.items()) + total + bound
            )
    return "\n".join(lines)
