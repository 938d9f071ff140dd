"""The local lane: draft and target in one process, the exact round and RNG protocol of
docs/design.md §2 (the cluster lane runs the same rounds across the wire and must emit the same
tokens for the same seed).

A draft that batches (torch, `muser.backend.batches`) drafts on a sequence of its own, the
KV a cluster session drafts on under lane.draft_batch: a session drafting alone there runs
this very path, so its sampled text equals this lane's bit for bit.

A feature-conditioned draft (`proposer_mac.backends.conditioned`) reads the target's capture
rows: the target is evaluated through a `CaptureTap`, every round hands the draft the rows
of what it committed. Until it has been handed any (the first round: the prompt has not been
read yet) the draft is not `ready` and declines: the target decodes one token, reading the
prompt on the way, as a cluster session's first round does."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from muser.backend import ModelBackend, batches
from muser.mt19937 import Mt19937
from muser.round import DEFAULT_Q_TOP_K, clip_emission
from muser.sampling import SamplingParams, target_probs
from muser.stats import LaneStats
from muser.verify import judge_round
from muser.width import FixedWidth, WidthPolicy
from muser_app.lanes.result import GenerationResult
from proposer_mac.drafting import Drafter
from verifier_gx.capture import CaptureTap
from verifier_gx.decode import decode_round
from verifier_gx.executor import TargetExecutor


class _Conditioning:
    """The target's capture rows, carried to a conditioned draft after every round."""

    def __init__(self, target: ModelBackend, drafter: Drafter) -> None:
        self.draft, self.drafter = drafter.cursor.backend, drafter
        self.draft.check_target(target.identity, "local lane")
        self.tap = CaptureTap(target, self.draft.capture_layers)

    def carry(self) -> None:
        """Hand the draft the rows of every committed position it lacks."""
        first, end = self.draft.features_known, self.tap.length
        if end > first:
            self.drafter.install_features(first, self.tap.rows(first, end))


def run_local(
    target: ModelBackend,
    draft: ModelBackend,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    draft_len: int = 4,
    q_top_k: int = DEFAULT_Q_TOP_K,
    record_rows: bool = False,
    on_tokens: Callable[[list[int]], None] | None = None,
    width: WidthPolicy | None = None,
) -> GenerationResult:
    """`width` chooses each round's D (default: `draft_len` every round)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if draft_len < 0:
        raise ValueError(f"draft_len must be >= 0, got {draft_len}")
    width = FixedWidth(draft_len) if width is None else width
    stats = LaneStats()
    drafter = Drafter(draft.sequence() if batches(draft) else draft, params, q_top_k)
    conditioning = None
    if hasattr(drafter.cursor.backend, "install_features"):
        conditioning = _Conditioning(target, drafter)
        drafter.cursor.claim()  # now: a draft reused from another run drops that run's rows
    executor = TargetExecutor(conditioning.tap if conditioning else target)
    rng = Mt19937.from_seed(params.seed)
    transcript = [int(t) for t in prompt]
    out: list[int] = []
    rows = {}
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        remaining = params.max_tokens - len(out)
        depth = width.choose(remaining)
        proposal = drafter.draft(transcript, rng, depth)
        t1 = time.perf_counter()
        depth = len(proposal.drafts)  # a draft may decline to propose (the n-gram draft)
        if depth == 0:  # a draftless round: the target decodes decode_len tokens itself
            k = 1 if conditioning is not None else width.decode_len(remaining)
            decoded = decode_round(executor, transcript, rng, k, params)
            logits, accepted, emitted = decoded.logits, 0, decoded.tokens
            rng = decoded.post_state
        else:
            logits = executor.witness_logits(transcript, proposal.drafts)
            witness = target_probs(logits, params)
            decision = judge_round(
                rng, transcript[-1], proposal.drafts, proposal.q_rows, witness, greedy=params.greedy
            )
            executor.settle(len(transcript), decision.accepted)
            accepted, emitted = decision.accepted, decision.emitted(proposal.drafts)
            rng = decision.post_state
        if conditioning is not None:
            conditioning.carry()
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        if record_rows:
            for k in range(len(emitted)):
                rows[len(transcript) + k] = logits[k]
        emission = clip_emission(emitted, len(out), params.max_tokens, params.stop_tokens)
        stats.observe_round(depth, accepted, len(emission.tokens))
        width.observe(
            depth, accepted, len(emitted), draft_s=t1 - t0, verify_s=t2 - t1, round_s=t2 - t0
        )
        stats.width = width.to_dict()
        out += emission.tokens
        transcript += emission.tokens
        if on_tokens:
            on_tokens(emission.tokens)
        if emission.done:
            break
    stats.wall_s = time.perf_counter() - start
    return GenerationResult("local", "", out, len(prompt), stats, rows)
