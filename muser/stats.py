"""Lane and daemon statistics, observed in one object and exported elsewhere (STYLE.md item 13).

`muser.metrics` exports them (Prometheus, and the fields of the daemons' Status JSON); the
bench and the CLI read `LaneStats.to_dict()`. Nothing here does I/O.

Conventions, written once:
- tokens per round counts every token a round emits, the next frontier included (a + 1);
- acceptance = accepted drafts / drafted tokens;
- the verifier-only ceiling = emitted tokens / sum of verifier compute wall (docs/design.md §10);
- the round split is draft, transport, verify (target compute + judge), wal (durable appends,
  the commit included), sign; each phase is summed (`draft_s`, ...) and kept per round in a
  histogram. `observe_round` closes a round: what the sums gained since the previous close is
  that round's split, so add a round's times before closing it (or pass them to it);
- latencies are in seconds; quantiles are exact over the most recent samples (`RECENT`).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PHASES = ("draft", "transport", "verify", "wal", "sign")
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
RECENT = 1024
"""Samples a histogram keeps for exact quantiles (p50/p99 in `muser status`)."""
RATE_WINDOW_S = 60.0
"""Tokens per second are counted over this trailing window."""


@dataclass
class Histogram:
    """Observations per bucket (inclusive upper bounds, then an overflow bucket), their count,
    sum and maximum, and the last `keep` samples for exact quantiles. Thread-safe: fsyncs are
    observed off the event loop."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    keep: int = RECENT
    counts: list[int] = field(default_factory=list)
    """Per bucket, not cumulative; one more entry than `bounds` (the overflow)."""
    count: int = 0
    sum: float = 0.0
    max: float | None = None
    recent: deque[float] = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"bucket bounds must increase strictly, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.recent = deque(maxlen=self.keep)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value
        with self._lock:
            self.counts[i] += 1
            self.count += 1
            self.sum += value
            self.max = value if self.max is None else max(self.max, value)
            self.recent.append(value)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, ending with (inf, count)."""
        with self._lock:
            counts = list(self.counts)
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float | None:
        """Nearest-rank q-quantile of the recent samples; None before the first one."""
        with self._lock:
            samples = sorted(self.recent)
        if not samples:
            return None
        return samples[max(0, math.ceil(q * len(samples)) - 1)]

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def merge(self, other: Histogram) -> None:
        if other.bounds != self.bounds:
            raise ValueError(f"cannot merge buckets {other.bounds} into {self.bounds}")
        with other._lock:
            counts, count, total = list(other.counts), other.count, other.sum
            peak, recent = other.max, list(other.recent)
        with self._lock:
            self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
            self.count += count
            self.sum += total
            if peak is not None:
                self.max = peak if self.max is None else max(self.max, peak)
            self.recent.extend(recent)


def _phase_histograms(phases: tuple[str, ...] = PHASES) -> dict[str, Histogram]:
    """Round split histograms keep no samples: a proposer holds one set per session."""
    return {p: Histogram(keep=0) for p in phases}


@dataclass
class LaneStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    """Target compute (evaluate + transforms + judge) wall, summed over rounds."""
    transport_s: float = 0.0
    wal_s: float = 0.0
    sign_s: float = 0.0
    tokens_per_round_hist: dict[int, int] = field(default_factory=dict)
    draft_len_hist: dict[int, int] = field(default_factory=dict)
    """Rounds per draft width D (the width policy's choices, `muser.width`)."""
    width: dict | None = None
    """The width policy's state after the last round (`WidthPolicy.to_dict`), per session."""
    speculated: int = 0
    """Rounds drafted ahead, on the guess that the round before is fully accepted."""
    speculation_hits: int = 0
    """Speculative drafts used: a guess that held, or a draft made on the early decision."""
    guess_hits: int = 0
    """Of those, the guesses (drafted before the decision was known) that held."""
    branch_hits: int = 0
    """Speculation hits on a round that rejected a draft: the guess drafted on the draft's
    runner-up at the rejection held (greedy branches)."""
    decisions_followed: int = 0
    """Next drafts started on the verifier's early decision, before its signed result,
    because the guess was wrong or missing (used when the result agreed: a hit)."""
    sent_ahead: int = 0
    """Requests journaled and sent on the early decision of the round before them, ahead
    of its signed result (lane.send_on_decision)."""
    ahead_void: int = 0
    """Of those, requests voided because the signed result differed from its decision."""
    queue_full_retries: int = 0
    """Rounds re-sent because the verifier's round queue was full (proposer)."""
    moves: int = 0
    """Times a session moved to another verifier of the pool (proposer_mac.pool)."""
    speculation_s: float = 0.0
    """Draft-thread wall spent speculating, off the critical path while rounds are away."""
    capture_bytes: int = 0
    """Capture-row fragment bytes the rounds' results named (a conditioned draft's features)."""
    feature_install_s: float = 0.0
    """Wall spent handing those rows to the draft (in the draft thread, behind any
    speculation running there)."""
    tree_nodes: int = 0
    """Nodes the lane's tree rounds drafted (docs/design.md §3). A tree round counts its depth
    in `drafted` and its accepted path in `accepted`, so acceptance means what a chain's
    does: of the tokens a round could accept, those it did."""
    tree_shape: list[int] | None = None
    """The shape its trees are drafted in, as nodes per depth (4,1,1,1 children per depth
    is 4,4,4,4; an adaptive policy's current template); None: chains."""
    tree_policy: dict | None = None
    """The tree policy's own report (`muser.tree_width`), when the lane has one."""
    phases: dict[str, Histogram] = field(default_factory=_phase_histograms)
    """Per-round split, one histogram per phase this lane measures."""
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    recent_emitted: deque[tuple[float, int]] = field(default_factory=deque, repr=False)
    """(clock time, tokens) of the rounds closed in the last `RATE_WINDOW_S`."""
    _closed: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def observe_round(
        self,
        drafted: int,
        accepted: int,
        emitted: int,
        *,
        draft_s: float = 0.0,
        transport_s: float = 0.0,
        verify_s: float = 0.0,
        wal_s: float = 0.0,
        sign_s: float = 0.0,
    ) -> None:
        """Close one round: count it, add the times given, and observe the round's split."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.tokens_per_round_hist[emitted] = self.tokens_per_round_hist.get(emitted, 0) + 1
        self.draft_len_hist[drafted] = self.draft_len_hist.get(drafted, 0) + 1
        self.draft_s += draft_s
        self.transport_s += transport_s
        self.verify_s += verify_s
        self.wal_s += wal_s
        self.sign_s += sign_s
        for phase, histogram in self.phases.items():
            total = getattr(self, f"{phase}_s")
            histogram.observe(total - self._closed.get(phase, 0.0))
            self._closed[phase] = total
        now = self.clock()
        self.recent_emitted.append((now, emitted))
        self.prune(now)

    def prune(self, now: float | None = None) -> None:
        """Forget rounds older than the rate window (`tokens_per_s` over the last minute)."""
        now = self.clock() if now is None else now
        while self.recent_emitted and self.recent_emitted[0][0] < now - RATE_WINDOW_S:
            self.recent_emitted.popleft()

    def emitted_since(self, since: float) -> int:
        """Tokens emitted by rounds closed at clock time >= since (within the rate window)."""
        return sum(n for t, n in self.recent_emitted if t >= since)

    def merge(self, other: LaneStats) -> None:
        """Add another lane's counts (the proposer sums its sessions at scrape time)."""
        for name in (
            "rounds", "drafted", "accepted", "emitted", "wall_s", "draft_s", "verify_s",
            "transport_s", "wal_s", "sign_s", "speculated", "speculation_hits", "speculation_s",
            "queue_full_retries", "decisions_followed", "branch_hits", "guess_hits", "sent_ahead",
            "ahead_void", "moves", "capture_bytes", "feature_install_s", "tree_nodes",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.tokens_per_round_hist, other.tokens_per_round_hist),
            (self.draft_len_hist, other.draft_len_hist),
        ):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
        for phase, histogram in other.phases.items():
            mine = self.phases.setdefault(phase, Histogram(histogram.bounds, histogram.keep))
            mine.merge(histogram)
        self.recent_emitted.extend(other.recent_emitted)

    @classmethod
    def total(cls, lanes: Iterable[LaneStats]) -> LaneStats:
        out = cls(phases={})
        for lane in lanes:
            out.merge(lane)
        return out

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def verifier_ceiling(self) -> float:
        return self.emitted / self.verify_s if self.verify_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 6),
            "tokens_per_round": round(self.tokens_per_round, 6),
            "wall_s": round(self.wall_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "split_s": {
                "draft": round(self.draft_s, 6),
                "transport": round(self.transport_s, 6),
                "verify": round(self.verify_s, 6),
                "wal": round(self.wal_s, 6),
                "sign": round(self.sign_s, 6),
            },
            "verifier_ceiling_tokens_per_s": round(self.verifier_ceiling, 3),
            "speculation": {
                "rounds": self.speculated,
                "hits": self.speculation_hits,
                "branch_hits": self.branch_hits,
                "guess_hits": self.guess_hits,
                "on_decision": self.decisions_followed,
                "sent_ahead": self.sent_ahead,
                "ahead_void": self.ahead_void,
                "seconds": round(self.speculation_s, 6),
            },
            "capture": {
                "bytes": self.capture_bytes,
                "bytes_per_round": round(self.capture_bytes / max(1, self.rounds), 1),
                "install_s": round(self.feature_install_s, 6),
            },
            "tree": {
                "shape": self.tree_shape,
                "nodes": self.tree_nodes,
                "nodes_per_round": round(self.tree_nodes / max(1, self.rounds), 3),
                "policy": self.tree_policy,
            },
            "rounds_by_draft_len": {str(k): n for k, n in sorted(self.draft_len_hist.items())},
            "width": self.width,
            "moves": self.moves,
        }


VERIFIER_PHASES = ("verify", "wal", "sign")


@dataclass
class DaemonStats:
    """What a daemon observes besides its rounds: refusals by reason and the fsyncs of its
    WAL (fed by `wal.log.FileLog(on_fsync=...)`)."""

    refusals: dict[str, int] = field(default_factory=dict)
    refusal_codes: dict[str, str] = field(default_factory=dict)
    """reason -> the gRPC status code name it is refused with (one code per reason)."""
    fsync: Histogram = field(default_factory=Histogram)
    faults: dict[str, str] = field(default_factory=dict)
    """Component -> why it cannot do its part now (muser.health): none while SERVING."""
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    started: float | None = None
    """Clock time the daemon started (default: when this object was made)."""

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def observe_refusal(self, reason: str, code: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self.refusal_codes[reason] = code

    def observe_fsync(self, seconds: float) -> None:
        self.fsync.observe(seconds)


@dataclass
class DraftingStats:
    """The proposer's draft thread. A draft batch is the rounds (drafts or speculations) of
    different sessions drafted in lockstep, one forward per draft step across them; a round
    drafted alone is a batch of one. Observed in the draft thread, read on the event loop."""

    batch_sizes: dict[int, int] = field(default_factory=dict)
    """Batch size -> batches of that size."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def observe_batch(self, size: int) -> None:
        with self._lock:
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def snapshot(self) -> dict[int, int]:
        """Batch size -> batches, as of now."""
        with self._lock:
            return dict(self.batch_sizes)

    def to_dict(self) -> dict[str, int]:
        """The histogram with string keys, as the status JSON carries it."""
        return {str(k): n for k, n in sorted(self.snapshot().items())}


@dataclass
class VerifierStats(LaneStats, DaemonStats):
    """The verifier's rounds (no draft or transport phase there) plus its daemon stats.

    Batching conventions: a batch is the rounds of different sessions evaluated in one target
    forward; a batched round's `verify_s` is its share of the batch's compute wall (so the sum
    stays the target's wall and the ceiling stays a bound). The queue is the rounds waiting
    for the target; `queue_full` counts rounds refused because it was full."""

    retries: int = 0
    resumes: int = 0
    """Sessions this verifier resumed from a round it did not hold (an open's resume point)."""
    idle_closed: int = 0
    """Sessions this verifier closed itself after limits.session_idle_s without use."""
    phases: dict[str, Histogram] = field(default_factory=lambda: _phase_histograms(VERIFIER_PHASES))
    batches: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """Batch size -> batches of that size."""
    queue_depth_max: int = 0
    """Most rounds waiting for the target at once (the batch computing not included)."""
    queue_full: int = 0
    """Rounds refused because the round queue was full (limits.round_queue)."""
    kv_evictions: int = 0
    """Sessions whose target KV was dropped for another (limits.kv_sessions)."""
    kv_rebuilt_tokens: int = 0
    """Transcript tokens re-evaluated because a session's KV was not held (first round after
    an eviction or a restart, or sessions interleaving on a backend with one shared KV)."""
    lookaheads: int = 0
    """Rounds evaluated before their request, on the proposer's Lookahead hint."""
    lookahead_hits: int = 0
    """Rounds whose request named the tokens of their lookahead: no forward of their own."""
    lookahead_s: float = 0.0
    """Target wall of every lookahead forward, the ones no request used included."""

    def observe_batch(self, size: int, waiting: int) -> None:
        """A batch of `size` rounds starts; `waiting` rounds stay queued behind it."""
        self.batches += 1
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def observe_queue(self, waiting: int) -> None:
        """A round joined the queue; `waiting` rounds wait now."""
        self.queue_depth_max = max(self.queue_depth_max, waiting)

    @property
    def mean_batch(self) -> float:
        """Rounds per batch."""
        return (
            sum(k * n for k, n in self.batch_sizes.items()) / self.batches if self.batches else 0.0
        )

    @property
    def wal_max_s(self) -> float:
        """Longest round append (the commit log's group commit included)."""
        return self.phases["wal"].max or 0.0
