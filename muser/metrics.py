"""Prometheus export of what the daemons observe (STYLE.md item 13: observed in muser.stats,
exported here). Read at scrape time by a custom collector: nothing here runs per round.

Each daemon hands a function returning a `DaemonView` (its stats as they are now); the same
view feeds `/metrics` (`serve_metrics`, `metrics_route`) and the common fields of its
Status JSON (`status_fields`). Both daemons export the same names; the scrape target tells
them apart and `muser_info` names the role. On the proposer the verify, wal and sign phases
are what the verifier reported per round (wal adds the proposer's COMMITTED append).

    muser_info{role,key_id}                 gauge      1
    muser_serving                           gauge      1 SERVING, 0 NOT_SERVING (muser.health)
    muser_fault{component,reason}           gauge      1 per standing fault (wal, target, draft)
    muser_sessions                          gauge      sessions held (finished, not closed, too)
    muser_open_sessions                     gauge      sessions not finished
    muser_rounds_total                      counter    rounds committed
    muser_drafted_tokens_total              counter    draft tokens proposed
    muser_accepted_tokens_total             counter    draft tokens accepted
    muser_emitted_tokens_total              counter    tokens emitted (accepted + next frontier)
    muser_speculated_rounds_total           counter    rounds drafted ahead (latency hiding)
    muser_speculation_hits_total            counter    speculative drafts used (guess held)
    muser_speculation_branch_hits_total     counter    hits after a rejected draft (greedy branches)
    muser_decisions_followed_total          counter    next drafts started on an early decision
    muser_sent_ahead_total                  counter    requests sent on the round before's decision
    muser_ahead_void_total                  counter    of those, voided by a differing result
    muser_session_moves_total               counter    sessions moved to another pool verifier
    muser_capture_bytes_total               counter    capture-row bytes results named (proposer)
    muser_feature_install_seconds_total     counter    time handing them to the draft (proposer)
    muser_tree_nodes_total                  counter    nodes tree rounds drafted (proposer)
    muser_acceptance_ratio                  gauge      accepted / drafted
    muser_tokens_per_round                  histogram  tokens a round emits (a + 1)
    muser_rounds_by_draft_len_total{draft_len} counter rounds per draft width D (lane.width)
    muser_round_phase_seconds{phase}        histogram  per-round split: draft, transport,
                                                       verify, wal, sign
    muser_verifier_ceiling_tokens_per_second gauge     emitted / sum of verifier compute wall
    muser_wal_fsync_seconds                 histogram  fsync latency of the daemon's WAL
    muser_wal_bytes                         gauge      bytes on disk in the WAL directory
    muser_refusals_total{reason,code}       counter    refusals by reason and gRPC status
    muser_retries_total                     counter    retries answered from the WAL (verifier)
    muser_gc_frozen_objects                 gauge      objects frozen out of the cyclic
                                                       collector at startup (muser.heap)
    muser_gc_collections_total{generation}  counter    the collector's passes
    muser_gc_pause_seconds_total{generation} counter   time they held the GIL

Verifier only (rounds of many sessions batched into one target forward):

    muser_batch_size                        histogram  rounds per target forward
    muser_round_queue_depth                 gauge      rounds waiting for the target now
    muser_round_queue_depth_max             gauge      most rounds queued at once
    muser_round_queue_full_total            counter    rounds refused: queue full (round_queue)
    muser_kv_sessions                       gauge      sessions holding target KV now
    muser_kv_evictions_total                counter    sessions' KV dropped (kv_sessions cap)
    muser_kv_rebuilt_tokens_total           counter    transcript tokens re-evaluated
    muser_resumes_total                     counter    sessions resumed from a proposer's
                                                       signed round (another node, lost log)
    muser_idle_closed_total                 counter    sessions closed after
                                                       limits.session_idle_s unused

Proposer only (rounds of many sessions drafted together, lane.draft_batch):

    muser_draft_batch_size                  histogram  rounds drafted per lockstep draft batch
    muser_sessions_by_verifier{verifier}    gauge      unfinished sessions per pool verifier
    muser_verifier_fences_total             counter    verifiers a moved session left, told
                                                       its new epoch (they refuse the old)
    muser_fragment_bytes_sent_total         counter    fragment bytes sent to verifiers (opens,
                                                       missing_fragments answers)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from muser import heap
from muser.stats import (
    RATE_WINDOW_S,
    DaemonStats,
    DraftingStats,
    Histogram,
    LaneStats,
    VerifierStats,
)

TOKENS_PER_ROUND_BUCKETS = (*range(1, 17), 24, 32, 48, 65)
"""Upper bounds for tokens per round: one bucket per count up to 16 (draft_len <= 64)."""
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
"""Upper bounds for rounds per batch (limits.max_batch)."""


@dataclass(frozen=True)
class DaemonView:
    """One daemon's stats at one moment, as the exporter and the Status JSON read them."""

    role: str
    key_id: str
    lane: LaneStats
    """Rounds, summed over the daemon's sessions."""
    daemon: DaemonStats
    """Refusals and WAL fsyncs."""
    sessions: int
    open_sessions: int
    wal_dir: Path | None
    now: float
    """The daemon's clock now (the clock of `daemon.started`)."""
    retries: int | None = None
    verifier: VerifierStats | None = None
    """The verifier's batching and KV stats (None on the proposer)."""
    round_queue: int | None = None
    """Rounds waiting for the target now (verifier)."""
    kv_sessions: int | None = None
    """Sessions holding target KV now (verifier)."""
    drafting: DraftingStats | None = None
    """The proposer's draft thread (None on the verifier)."""
    placement: dict[str, int] | None = None
    """Unfinished sessions by the pool verifier they live on (proposer)."""
    fences: int = 0
    """Verifiers a moved session left, told its new epoch (proposer)."""
    fragment_bytes: int = 0
    """Fragment bytes sent to verifiers (proposer)."""


def wal_bytes(directory: Path | None) -> int | None:
    """Bytes of the regular files under a WAL directory (segments, snapshots, quarantine)."""
    if directory is None:
        return None
    total = 0
    for path in Path(directory).rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:  # a segment dropped by a snapshot meanwhile
            continue
    return total


def tokens_per_s(view: DaemonView) -> float:
    """Tokens emitted over the trailing window (or the uptime, when shorter), per second."""
    span = min(RATE_WINDOW_S, view.now - view.daemon.started)
    if span <= 0:
        return 0.0
    return view.lane.emitted_since(view.now - RATE_WINDOW_S) / span


def status_fields(view: DaemonView) -> dict:
    """The fields both daemons' Status JSON carry (`muser status` prints them)."""
    lane, fsync = view.lane, view.daemon.fsync
    return {
        "serving": not view.daemon.faults,
        "faults": dict(view.daemon.faults),
        "sessions": view.sessions,
        "open_sessions": view.open_sessions,
        "rounds": lane.rounds,
        "drafted": lane.drafted,
        "accepted": lane.accepted,
        "emitted": lane.emitted,
        "acceptance": lane.acceptance,
        "tokens_per_round": lane.tokens_per_round,
        "rounds_by_draft_len": {str(k): n for k, n in sorted(lane.draft_len_hist.items())},
        "tokens_per_s": tokens_per_s(view),
        "uptime_s": view.now - view.daemon.started,
        "verifier_ceiling_tok_s": lane.verifier_ceiling if lane.verify_s > 0 else None,
        "refusals": dict(view.daemon.refusals),
        "wal": {
            "dir": str(view.wal_dir) if view.wal_dir is not None else None,
            "bytes": wal_bytes(view.wal_dir),
            "fsyncs": fsync.count,
            "fsync_mean_s": fsync.mean,
            "fsync_p50_s": fsync.quantile(0.5),
            "fsync_p99_s": fsync.quantile(0.99),
            "fsync_max_s": fsync.max,
        },
        "gc": heap.WATCH.status(),
    }


# ---- Prometheus ---------------------------------------------------------------------------


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    return [
        ("+Inf" if math.isinf(bound) else floatToGoString(bound), float(n))
        for bound, n in histogram.cumulative()
    ]


def _tokens_per_round(lane: LaneStats) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "muser_tokens_per_round", "Tokens a round emits: accepted drafts plus the next frontier."
    )
    counts = sorted(lane.tokens_per_round_hist.items())
    buckets = [
        (floatToGoString(b), float(sum(n for k, n in counts if k <= b)))
        for b in TOKENS_PER_ROUND_BUCKETS
    ]
    buckets.append(("+Inf", float(lane.rounds)))
    family.add_metric([], buckets, float(lane.emitted))
    return family


def _size_histogram(name: str, doc: str, sizes: dict[int, int]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc)
    counts = sorted(sizes.items())
    buckets = [
        (floatToGoString(b), float(sum(n for k, n in counts if k <= b))) for b in BATCH_SIZE_BUCKETS
    ]
    buckets.append(("+Inf", float(sum(sizes.values()))))
    family.add_metric([], buckets, float(sum(k * n for k, n in counts)))
    return family


def _batch_sizes(stats: VerifierStats) -> HistogramMetricFamily:
    return _size_histogram(
        "muser_batch_size", "Rounds evaluated per target forward.", stats.batch_sizes
    )


def _verifier_families(v: DaemonView) -> Iterator[Metric]:
    s = v.verifier
    if s is None:
        return
    yield _batch_sizes(s)
    if v.round_queue is not None:
        yield GaugeMetricFamily(
            "muser_round_queue_depth", "Rounds waiting for the target now.", value=v.round_queue
        )
    yield GaugeMetricFamily(
        "muser_round_queue_depth_max", "Most rounds queued at once.", value=s.queue_depth_max
    )
    yield CounterMetricFamily(
        "muser_round_queue_full",
        "Rounds refused because the round queue was full (limits.round_queue).",
        value=s.queue_full,
    )
    if v.kv_sessions is not None:
        yield GaugeMetricFamily(
            "muser_kv_sessions", "Sessions holding target KV now.", value=v.kv_sessions
        )
    yield CounterMetricFamily(
        "muser_kv_evictions",
        "Sessions whose target KV was dropped for another (limits.kv_sessions).",
        value=s.kv_evictions,
    )
    yield CounterMetricFamily(
        "muser_kv_rebuilt_tokens",
        "Transcript tokens re-evaluated because a session's KV was not held.",
        value=s.kv_rebuilt_tokens,
    )
    yield CounterMetricFamily(
        "muser_resumes",
        "Sessions resumed from a round this verifier did not hold, signed by an enrolled one.",
        value=s.resumes,
    )
    yield CounterMetricFamily(
        "muser_idle_closed",
        "Sessions this verifier closed itself after limits.session_idle_s without use.",
        value=s.idle_closed,
    )


def _gc_families(gc: dict) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "muser_gc_frozen_objects",
        "Objects frozen out of Python's cyclic collector once the daemon had loaded.",
        value=gc["frozen"],
    )
    passes = CounterMetricFamily(
        "muser_gc_collections", "Passes of Python's cyclic collector.", labels=["generation"]
    )
    pauses = CounterMetricFamily(
        "muser_gc_pause_seconds",
        "Seconds Python's cyclic collector ran (holding the GIL: every thread waits).",
        labels=["generation"],
    )
    for generation in heap.GENERATIONS:
        passes.add_metric([str(generation)], gc["collections"][generation])
        pauses.add_metric([str(generation)], gc["pause_s"][generation])
    yield passes
    yield pauses


class StatsCollector(Collector):
    """Reads a daemon's stats at scrape time (`view()` is called once per scrape)."""

    def __init__(self, view: Callable[[], DaemonView]) -> None:
        self.view = view

    def describe(self) -> list[Metric]:
        return []  # the families depend on the view; registered with auto_describe off

    def collect(self) -> Iterator[Metric]:
        v = self.view()
        lane, daemon = v.lane, v.daemon
        info = GaugeMetricFamily(
            "muser_info", "The daemon's role and key id.", labels=["role", "key_id"]
        )
        info.add_metric([v.role, v.key_id], 1.0)
        yield info
        faults = dict(daemon.faults)
        yield GaugeMetricFamily(
            "muser_serving",
            "1 while the daemon's health check answers SERVING, 0 while a fault stands.",
            value=0.0 if faults else 1.0,
        )
        fault = GaugeMetricFamily(
            "muser_fault",
            "A component that cannot do its part now, and why (1 while it stands).",
            labels=["component", "reason"],
        )
        for component, reason in sorted(faults.items()):
            fault.add_metric([component, reason], 1.0)
        yield fault
        yield GaugeMetricFamily(
            "muser_sessions", "Sessions held (finished ones too, until closed).", value=v.sessions
        )
        yield GaugeMetricFamily(
            "muser_open_sessions", "Sessions not finished.", value=v.open_sessions
        )
        yield from _lane_families(lane)
        fsync = HistogramMetricFamily("muser_wal_fsync_seconds", "fsync latency of the WAL.")
        fsync.add_metric([], _buckets(daemon.fsync), daemon.fsync.sum)
        yield fsync
        size = wal_bytes(v.wal_dir)
        if size is not None:
            yield GaugeMetricFamily("muser_wal_bytes", "Bytes on disk in the WAL.", value=size)
        refusals = CounterMetricFamily(
            "muser_refusals",
            "Refusals by reason and the gRPC status they are answered with.",
            labels=["reason", "code"],
        )
        for reason, n in sorted(daemon.refusals.items()):
            refusals.add_metric([reason, daemon.refusal_codes.get(reason, "")], n)
        yield refusals
        if v.retries is not None:
            yield CounterMetricFamily(
                "muser_retries", "Retries answered with the committed result.", value=v.retries
            )
        yield from _gc_families(heap.WATCH.status())
        yield from _verifier_families(v)
        if v.placement is not None:
            placed = GaugeMetricFamily(
                "muser_sessions_by_verifier",
                "Unfinished sessions by the pool verifier they live on (proposer).",
                labels=["verifier"],
            )
            for name, n in sorted(v.placement.items()):
                placed.add_metric([name], float(n))
            yield placed
            yield CounterMetricFamily(
                "muser_verifier_fences",
                "Verifiers a moved session left, told its new epoch: they refuse the old one "
                "(proposer).",
                value=v.fences,
            )
            yield CounterMetricFamily(
                "muser_fragment_bytes_sent",
                "Fragment bytes sent to verifiers: opens and missing_fragments answers (proposer).",
                value=v.fragment_bytes,
            )
        if v.drafting is not None:
            yield _size_histogram(
                "muser_draft_batch_size",
                "Rounds of concurrent sessions drafted per lockstep draft batch.",
                v.drafting.snapshot(),
            )


_LANE_COUNTERS = (
    ("muser_rounds", "Rounds committed.", "rounds"),
    ("muser_drafted_tokens", "Draft tokens proposed.", "drafted"),
    ("muser_accepted_tokens", "Draft tokens accepted.", "accepted"),
    (
        "muser_emitted_tokens",
        "Tokens emitted: accepted drafts plus each round's next frontier.",
        "emitted",
    ),
    (
        "muser_speculated_rounds",
        "Rounds drafted while the round before was at the verifier (proposer).",
        "speculated",
    ),
    (
        "muser_speculation_hits",
        "Speculative drafts used because their guess held (proposer).",
        "speculation_hits",
    ),
    (
        "muser_speculation_branch_hits",
        "Speculation hits on rounds that rejected a draft: the draft's runner-up there "
        "was the target's pick (proposer, greedy branches).",
        "branch_hits",
    ),
    (
        "muser_decisions_followed",
        "Next drafts started on the verifier's early decision, before its signed "
        "result (proposer).",
        "decisions_followed",
    ),
    (
        "muser_sent_ahead",
        "Requests journaled and sent on the early decision of the round before them, "
        "ahead of its signed result (proposer, lane.send_on_decision).",
        "sent_ahead",
    ),
    (
        "muser_session_moves",
        "Sessions moved to another verifier of the pool: unreachable past "
        "proposer.failover_s, or fenced (proposer).",
        "moves",
    ),
    (
        "muser_ahead_void",
        "Requests sent ahead and voided: the signed result of the round before "
        "differed from its early decision (proposer).",
        "ahead_void",
    ),
    (
        "muser_capture_bytes",
        "Capture-row fragment bytes the rounds' signed results named: a conditioned "
        "draft's features (proposer).",
        "capture_bytes",
    ),
    (
        "muser_feature_install_seconds",
        "Seconds spent handing capture rows to the conditioned draft (proposer).",
        "feature_install_s",
    ),
    (
        "muser_tree_nodes",
        "Nodes the tree rounds drafted (lane.tree_nodes; a tree counts its depth in "
        "drafted, its accepted path in accepted) (proposer).",
        "tree_nodes",
    ),
)
"""(name, help, LaneStats attribute) of the round counters."""


def _lane_families(lane: LaneStats) -> Iterator[Metric]:
    """The rounds: counts, acceptance, widths, the per-round time split and the ceiling."""
    for name, doc, attribute in _LANE_COUNTERS:
        yield CounterMetricFamily(name, doc, value=getattr(lane, attribute))
    yield GaugeMetricFamily(
        "muser_acceptance_ratio", "Accepted drafts / drafted tokens.", value=lane.acceptance
    )
    yield _tokens_per_round(lane)
    widths = CounterMetricFamily(
        "muser_rounds_by_draft_len",
        "Rounds per draft width D: the width policy's choices (lane.width).",
        labels=["draft_len"],
    )
    for depth, n in sorted(lane.draft_len_hist.items()):
        widths.add_metric([str(depth)], float(n))
    yield widths
    phases = HistogramMetricFamily(
        "muser_round_phase_seconds",
        "Per-round time split: draft, transport, verify (target compute + judge), wal "
        "(durable appends), sign.",
        labels=["phase"],
    )
    for phase, histogram in lane.phases.items():
        phases.add_metric([phase], _buckets(histogram), histogram.sum)
    yield phases
    yield GaugeMetricFamily(
        "muser_verifier_ceiling_tokens_per_second",
        "Emitted tokens / sum of verifier compute wall: a bound no deployment can beat.",
        value=lane.verifier_ceiling,
    )


def registry(view: Callable[[], DaemonView]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(view))
    return reg


def exposition(view: Callable[[], DaemonView]) -> bytes:
    """The text exposition format (version 0.0.4) of one scrape."""
    return generate_latest(registry(view))


# ---- HTTP ---------------------------------------------------------------------------------


def metrics_handler(view: Callable[[], DaemonView]):
    """An aiohttp handler serving `exposition(view)`."""
    from aiohttp import web

    reg = registry(view)

    async def handle(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
        )

    return handle


def metrics_route(view: Callable[[], DaemonView]):
    """GET /metrics as an aiohttp RouteDef (the proposer adds it to its HTTP API's app)."""
    from aiohttp import web

    return web.get("/metrics", metrics_handler(view))


async def serve_metrics(
    address: str, view: Callable[[], DaemonView], ssl_context=None, api_keys: Sequence[str] = ()
):
    """Start a small HTTP server with GET /metrics on HOST:PORT (port 0: any free port;
    HTTPS with `ssl_context`; a Bearer key from `api_keys` required when there are any).
    Returns (runner, port); `await runner.cleanup()` stops it."""
    from aiohttp import web

    from muser.errors import RefusedError
    from muser.http_auth import bearer_auth

    app = web.Application(middlewares=[bearer_auth(api_keys)])
    app.add_routes([metrics_route(view)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = address.rpartition(":")
    site = web.TCPSite(runner, host.strip("[]"), int(port), ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise RefusedError(f"cannot serve metrics on {address!r}: {exc}") from exc
    bound = runner.addresses[0][1] if runner.addresses else int(port)
    return runner, bound
