"""The plain lane: the target decoding alone — the non-speculative oracle (docs/design.md §8).

One MT19937 draw per emitted token at T > 0 (sample_ordered over the full target row); none
when greedy. Greedy output is what every speculative lane must reproduce token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from muser.backend import ModelBackend
from muser.cursor import KvCursor
from muser.mt19937 import Mt19937
from muser.round import clip_emission
from muser.sampling import SamplingParams, argmax_lowest, sample_ordered, target_probs
from muser.stats import LaneStats
from muser_app.lanes.result import GenerationResult


def run_plain(
    target: ModelBackend,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    record_rows: bool = False,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    stats = LaneStats()
    rng = Mt19937.from_seed(params.seed)
    cursor = KvCursor(target)
    transcript = [int(t) for t in prompt]
    out: list[int] = []
    rows = {}
    start = time.perf_counter()
    cursor.hold(transcript[:-1])
    while True:
        t0 = time.perf_counter()
        logits = cursor.extend([transcript[-1]])[-1]
        p = target_probs(logits, params)
        token = argmax_lowest(p) if params.greedy else sample_ordered(p, rng.uniform_f64())
        stats.verify_s += time.perf_counter() - t0
        if record_rows:
            rows[len(transcript)] = logits
        emission = clip_emission([token], len(out), params.max_tokens, params.stop_tokens)
        stats.observe_round(0, 0, len(emission.tokens))
        out += emission.tokens
        transcript += emission.tokens
        if on_tokens:
            on_tokens(emission.tokens)
        if emission.done:
            break
    stats.wall_s = time.perf_counter() - start
    return GenerationResult("plain", "", out, len(prompt), stats, rows)
