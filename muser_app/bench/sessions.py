"""`muser bench --suite sessions`: N concurrent sessions against one verifier.

The cluster is the bench's own (`muser_app.bench.cluster.cluster_lanes` at 0 ms: one verifier,
one proposer, real daemons on loopback, the lane qualified for real). For each N in
`--sessions` (e.g. 1,8), N generations on N different natural prompts start together, one
client thread each; the run's rate is all tokens emitted / the wall from the first start to
the last finish. Repeats interleave the values of N (so drift hits them alike); the median
over repeats is reported with its spread and the ratio to N = 1 (or the smallest N). Every
generation is a sample in the receipt (SHA-256 over the samples, `muser_app.bench.run`); at
temperature 0 each one is checked against plain target decode of its prompt.

Variants (`--cluster-variant NAME: SETTINGS`): a second cluster with those settings runs
the same waves, each of its waves right beside the base cluster's wave of the same N and
repeat (their order alternating), so that its paired ratio (the median over repeats of
variant rate / base rate) compares the two through the same phase of the machine.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from muser.affinity import pinned
from muser.sampling import SamplingParams
from muser_app.bench.run import core_bound, core_bound_note
from muser_app.bench.sample import LaneFn, Sample
from muser_app.procs import cpu_since


def run_concurrent(
    lane: LaneFn, prompts: list[list[int]], max_tokens: int
) -> tuple[list[Sample], float, dict[str, float]]:
    """Start one generation per prompt at once; returns their samples, the wall and the CPU
    seconds each of the lane's daemons (`lane.daemons`, {role: Daemon}) spent meanwhile."""
    spent = cpu_since(getattr(lane, "daemons", {}))
    # the whole wave on the clients' CPUs (the proposer's, `lane.cpus`), so that the runs' own
    # pinning (each pins the process and restores it) only ever finds and restores those
    cpus = getattr(lane, "cpus", {}).get("proposer")
    with pinned(cpus, "proposer.cpus"), ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        start = time.perf_counter()
        futures = [pool.submit(lane, p, max_tokens) for p in prompts]
        samples = [f.result() for f in futures]
        wall = time.perf_counter() - start
    cpu = spent()
    for i, s in enumerate(samples):
        s.prompt = i
        s.cpu_s = {}  # each run's window held the others' CPU too: the wave's is kept instead
    return samples, wall, cpu


def label(n: int, variant: str = "") -> str:
    """A wave's lane: "sessions=N", or "sessions=N[NAME]" on a variant's cluster."""
    return f"sessions={n}[{variant}]" if variant else f"sessions={n}"


def parse_label(text: str) -> tuple[int, str]:
    """(N, variant name or "") of a `label`."""
    n, _, rest = text.removeprefix("sessions=").partition("[")
    return int(n), rest.removesuffix("]")


def run_sessions_bench(
    lane: LaneFn,
    prompts: list[list[int]],
    sessions: list[int],
    max_tokens: int,
    repeats: int,
    progress: bool = True,
    variants: dict[str, LaneFn] | None = None,
) -> tuple[list[Sample], dict[str, list[float]]]:
    """Samples of every generation, and per wave lane (`label`) the rate (tokens/s) of each
    repeat; each of `variants` (name: its cluster's lane) runs every wave beside `lane`'s.
    When interrupted (Ctrl-C, or SIGTERM under `muser bench`), those of the runs done."""
    from tqdm import tqdm

    if max(sessions) > len(prompts):
        raise ValueError(f"{max(sessions)} sessions need as many prompts, got {len(prompts)}")
    clusters = {"": lane, **(variants or {})}
    for fn in clusters.values():
        fn(prompts[0][:8], 4)  # warm-up: first-call allocation and lazy init stay out
    samples: list[Sample] = []
    rates: dict[str, list[float]] = {label(n, v): [] for v in clusters for n in sessions}
    total = repeats * len(sessions) * len(clusters)
    with tqdm(total=total, desc="sessions", disable=not progress) as bar:
        try:
            for repeat in range(repeats):
                order = sessions if repeat % 2 == 0 else list(reversed(sessions))
                for i, n in enumerate(order):
                    names = list(clusters)
                    for name in names if (repeat + i) % 2 == 0 else reversed(names):
                        got, wall, cpu = run_concurrent(clusters[name], prompts[:n], max_tokens)
                        wave = {"run_wall": wall, **{f"run_cpu_{r}": v for r, v in cpu.items()}}
                        for s in got:
                            s.lane, s.repeat = label(n, name), repeat
                            s.split_s = {**s.split_s, **wave}  # the wave's, on each of its runs
                        samples += got
                        rates[label(n, name)].append(sum(len(s.tokens) for s in got) / wall)
                        bar.update()
        except KeyboardInterrupt:
            bar.write(f"sessions: interrupted after {bar.n} of {total} runs")
    return samples, {k: r for k, r in rates.items() if r}


def summarise_sessions(
    rates: dict[str, list[float]],
    samples: list[Sample],
    oracle: dict[int, list[int]] | None,
    cores: dict[str, dict[str, int]] | None = None,
) -> dict[str, dict]:
    """A row per wave lane (`label`): its median rate and spread, the ratio to its own
    cluster's smallest N, and on a variant's rows `ratio_to_base`, the median over repeats
    of its rate over the base cluster's at the same N (the paired comparison). `cores`:
    {variant ("" for the base cluster): {daemon: CPUs it is confined to}}; with a cluster's,
    its rows also get the bound of the busiest core (`core_bound`) and its ratio to the
    smallest N's rate."""
    keys = sorted(rates, key=lambda k: parse_label(k)[::-1])  # base first, then by N
    base_n = min(parse_label(k)[0] for k in keys)
    out: dict[str, dict] = {}
    for key in keys:
        n, variant = parse_label(key)
        rs = rates[key]
        ref = rates.get(label(base_n, variant))
        mine = [s for s in samples if s.lane == key]
        drafted = sum(s.drafted for s in mine)
        row = {
            "sessions": n,
            "variant": variant or None,
            "tokens_per_s": statistics.median(rs),
            "spread": [min(rs), max(rs)],
            f"ratio_to_{base_n}": statistics.median(rs) / statistics.median(ref) if ref else None,
            "per_session_tokens_per_s": statistics.median(rs) / n,
            "acceptance": sum(s.accepted for s in mine) / drafted if drafted else None,
        }
        if variant and (base := rates.get(label(n))):
            pairs = list(zip(rs, base, strict=False))
            row["ratio_to_base"] = statistics.median(v / b for v, b in pairs)
        row["cpu_ms_per_session_round"] = cpu = _cpu_per_round(mine)
        rounds = sum(s.rounds for s in mine)
        row["tokens_per_session_round"] = (
            sum(len(s.tokens) for s in mine) / rounds if rounds else None
        )
        bound = core_bound(cpu, row["tokens_per_session_round"], (cores or {}).get(variant, {}))
        if bound and ref:
            ceiling = bound["core_bound_tokens_per_s"]
            bound[f"core_bound_ratio_to_{base_n}"] = ceiling / statistics.median(ref)
        row |= bound
        if oracle is not None:
            same = [s.tokens == oracle[s.prompt] for s in mine]
            row["greedy_match_plain"] = f"{sum(same)}/{len(same)}"
        out[key] = row
    return out


def _cpu_per_round(samples: list[Sample]) -> dict[str, float]:
    """Each daemon's CPU ms per session-round: its CPU over every wave (read once per wave,
    carried by each of the wave's runs as run_cpu_<role>) over all the waves' rounds; {}
    unless every wave has the daemon's reading."""
    waves: dict[int, list[Sample]] = {}
    for s in samples:
        waves.setdefault(s.repeat, []).append(s)
    rounds = sum(s.rounds for s in samples)
    keys = [{k for k in ss[0].split_s if k.startswith("run_cpu_")} for ss in waves.values()]
    roles = sorted(set.intersection(*keys)) if keys else []
    if not rounds:
        return {}
    return {k[8:]: 1e3 * sum(ss[0].split_s[k] for ss in waves.values()) / rounds for k in roles}


def format_sessions(summary: dict[str, dict]) -> str:
    base = next(k for k in next(iter(summary.values())) if k.startswith("ratio_to_") and
                k != "ratio_to_base")  # fmt: skip
    paired = any("ratio_to_base" in r for r in summary.values())
    names = {
        k: f"{r['sessions']}[{r['variant']}]" if r.get("variant") else str(r["sessions"])
        for k, r in summary.items()
    }
    w = max(8, *map(len, names.values()))
    lines = [f"{'sessions':>{w}} {'tok/s':>8} {'spread':>13} {'×' + base[9:]:>6} {'tok/s/sess':>10} "
             f"{'accept':>7} {'=plain':>7}{'  ×base' if paired else ''}  "
             "CPU ms per session-round"]  # fmt: skip
    for key, r in summary.items():
        lo, hi = r["spread"]
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        ratio = f"{r[base]:.2f}" if r[base] is not None else "-"
        cpu = r.get("cpu_ms_per_session_round") or {}
        cpu_s = "  ".join(f"{k} {v:.2f}" for k, v in cpu.items()) or "-"
        if r.get(f"core_bound_{base}"):
            cpu_s += core_bound_note(r, r[f"core_bound_{base}"], base[9:])
        vs = f"{r['ratio_to_base']:.2f}" if "ratio_to_base" in r else "-"
        lines.append(
            f"{names[key]:>{w}} {r['tokens_per_s']:>8.1f} {f'{lo:.1f}–{hi:.1f}':>13} "
            f"{ratio:>6} {r['per_session_tokens_per_s']:>10.1f} {acc:>7} "
            f"{r.get('greedy_match_plain', '-'):>7}{f'  {vs:>5}' if paired else ''}  {cpu_s}"
        )
    return "\n".join(lines)


def oracle_tokens(
    target_dir,
    prompts: list[list[int]],
    params: SamplingParams,
    max_tokens: int,
    device: str = "cpu",
):
    """Plain target decode of each prompt on `device` (greedy only): what every session must
    emit, the verifier's target running on that device too."""
    from muser_app.lanes.plain import run_plain
    from verifier_gx.backends import load_target_backend

    target = load_target_backend("torch", target_dir, device=device)
    out = {}
    for i, p in enumerate(prompts):
        target.reset()
        out[i] = run_plain(target, p, replace(params, max_tokens=max_tokens)).tokens
    return out
