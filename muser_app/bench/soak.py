"""A soak (issue 35): many sessions through one cluster, at bounded concurrency, with both
daemons' resources sampled as the sessions finish.

    points, texts = soak(lane, daemons, prompts, sessions=1000, concurrency=16, ...)

Every `every` finished sessions a `Point` records each daemon's resident memory, open file
descriptors and threads (from /proc). The sessions cycle through `prompts`; each prompt is
first run once alone, and every soak session of it must give exactly that alone run's tokens
(a seeded sampled lane included: a session's tokens depend on its prompt and seed, never on
what else the cluster runs). `verdict` states the bounds a soak is held to; `plot` draws the
memory curve (docs/soak-memory.png; matplotlib, a dev dependency).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from muser_app.bench.sample import LaneFn

PAGE = 4096


@dataclass(frozen=True)
class Usage:
    rss_mb: float
    fds: int
    threads: int


@dataclass(frozen=True)
class Point:
    sessions: int
    """Sessions finished when this point was taken."""
    t_s: float
    usage: dict[str, Usage]
    """Per daemon role."""


def usage(pid: int) -> Usage:
    """Resident memory, open file descriptors and threads of a live process (Linux /proc)."""
    with open(f"/proc/{pid}/statm") as f:
        rss_pages = int(f.read().split()[1])
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    return Usage(rss_pages * PAGE / 2**20, fds, threads)


def soak(
    lane: LaneFn,
    pids: dict[str, int],
    prompts: list[list[int]],
    *,
    sessions: int,
    concurrency: int,
    max_tokens: int,
    every: int = 20,
    progress=None,
) -> tuple[list[Point], list[str]]:
    """Run `sessions` generations, `concurrency` at a time, cycling through `prompts`;
    returns the resource points and the mismatches (each a line naming the session whose
    tokens differ from its prompt's lone run; none is the pass)."""
    alone = [lane(p, max_tokens).tokens for p in prompts]
    start = time.perf_counter()
    points = [Point(0, 0.0, {role: usage(pid) for role, pid in pids.items()})]
    mismatches: list[str] = []
    lock, done = threading.Lock(), [0]

    def one(i: int) -> None:
        k = i % len(prompts)
        tokens = lane(prompts[k], max_tokens).tokens
        with lock:
            if tokens != alone[k]:
                mismatches.append(f"session {i} (prompt {k}): differs from its lone run at "
                                  f"token {first_difference(tokens, alone[k])}")  # fmt: skip
            done[0] += 1
            if done[0] % every == 0 or done[0] == sessions:
                usage_now = {role: usage(pid) for role, pid in pids.items()}
                points.append(Point(done[0], time.perf_counter() - start, usage_now))
                if progress is not None:
                    progress(points[-1])

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in as_completed([pool.submit(one, i) for i in range(sessions)]):
            future.result()
    return points, mismatches


def first_difference(a: list[int], b: list[int]) -> int:
    pairs = zip(a, b, strict=False)
    return next((j for j, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class Bounds:
    """What a soak is held to, after its warm-up (the first `warmup` of the sessions)."""

    warmup: float = 0.4
    """Both daemons settle in the first few hundred sessions; the proposer may later step
    up once more by 30-40 MB, at a point that varies from run to run (250-700 sessions
    into toy soaks), and stay level after: a high-water mark, not a trend."""
    rss_growth_mb: float = 64.0
    """Most a daemon's resident memory may grow from its largest warm-up value. Over the
    600 sessions after a 1,000-session soak's warm-up, a leak of about 100 KB a session or
    more breaks it; one step of the allocator's high-water mark (some 40 MB, seen on the
    proposer) does not."""
    fd_growth: int = 4
    thread_growth: int = 2
    """Threads a daemon may gain after the warm-up. Its worker pool is started whole
    (`muser.threads`): a pool that grew as calls first overlapped read as a leak here in
    one short soak in a few (verifier 14 threads after the warm-up, 18 at the end)."""


def verdict(points: list[Point], bounds: Bounds = Bounds()) -> list[str]:
    """The bounds a soak broke (none: it passed), per daemon: memory after the warm-up
    above the warm-up's largest value plus `rss_growth_mb`, and file descriptors or
    threads at the end above the warm-up's largest count plus their allowance."""
    total = points[-1].sessions
    warm = [p for p in points if p.sessions <= bounds.warmup * total]
    after = [p for p in points if p.sessions > bounds.warmup * total]
    broken = []
    for role in points[0].usage:
        base_rss = max(p.usage[role].rss_mb for p in warm)
        peak = max(p.usage[role].rss_mb for p in after)
        if peak > base_rss + bounds.rss_growth_mb:
            broken.append(f"{role}: resident memory rose to {peak:.0f} MB after the warm-up, "
                          f"over its {base_rss:.0f} MB + {bounds.rss_growth_mb:g} MB")  # fmt: skip
        for name, allowed in (("fds", bounds.fd_growth), ("threads", bounds.thread_growth)):
            base = max(getattr(p.usage[role], name) for p in warm)
            end = getattr(points[-1].usage[role], name)
            if end > base + allowed:
                broken.append(f"{role}: {end} {name} at the end, over the warm-up's {base} + "
                              f"{allowed}")  # fmt: skip
    return broken


def receipt(points: list[Point], meta: dict) -> dict:
    return {"meta": meta, "points": [asdict(p) for p in points]}


def plot(points: list[Point], path: Path, title: str) -> None:
    """Resident memory of each daemon against sessions finished (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for role in points[0].usage:
        ax.plot([p.sessions for p in points], [p.usage[role].rss_mb for p in points],
                label=f"{role} daemon")  # fmt: skip
    ax.set_xlabel("sessions finished")
    ax.set_ylabel("resident memory (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
