"""The benchmark harness (docs/design.md §10): lanes and peers on the same pair and prompts.

Discipline: every lane runs on every prompt in one process, lanes interleaved within each
repeat (so drift hits all of them alike), the median and spread over repeats reported, and
every raw sample kept in a receipt whose SHA-256 covers the samples' canonical JSON.
Threads: torch runs with one intra-op thread (tiny models are faster that way on the
2-core box, and it keeps the second core free for the OS and the harness); MLX runs on its
CPU stream. The cluster's daemons run on the CPUs `config init` gives each (half the
machine's each), and the harness is the client of a cluster run on the proposer's
(`muser_app.bench.cluster`, `--no-pin` to let the OS place them). The vLLM peer is the
exception to "one process": vLLM lives in its own environment, so it runs in a child process
(`muser_app.bench.vllm_peer`) that serves one run per request, keeping the warm-up and the
interleaved order; its child also uses one torch thread. Ratios are to plain target decode measured in
the same run.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
from pathlib import Path

from muser_app.bench.sample import LaneFn, Sample


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
        if any(s.ahead for s in all_s):
            out[lane]["ahead"] = _ahead(all_s)
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


def _ahead(samples: list[Sample]) -> dict:
    """A cluster lane's drafting ahead, summed over its runs, with the share of its rounds
    whose guess of their outcome held (`guess_hit_rate`: drafts used that were drafted on a
    guess, not on the decision; a draft made on a decision may go unused, when the width
    policy then picks another D)."""
    total = {k: sum(s.ahead.get(k, 0) for s in samples) for k in samples[0].ahead}
    held = total.get("guess_hits")  # (absent from older receipts)
    rate = held / total["rounds"] if held is not None and total["rounds"] else None
    return total | {"guess_hit_rate": rate}


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
    ahead = [(lane, r["ahead"]) for lane, r in summary.items() if r.get("ahead")]
    if ahead:
        lines.append("drafting ahead (the next round drafted while one is away):")
        for lane, a in ahead:
            rate = "-" if a["guess_hit_rate"] is None else f"{a['guess_hit_rate']:.2f}"
            lines.append(f"  {lane:<18} rounds {a['rounds']}  used {a['hits']} (on the decision "
                         f"{a['on_decision']}; the guess held {rate})  sent on the decision "
                         f"{a['sent_ahead']}  void {a['ahead_void']}")  # fmt: skip
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
