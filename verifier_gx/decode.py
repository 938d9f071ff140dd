"""Verifier-side decode: a round without drafts that emits several tokens.

When drafting does not pay, the proposer sends rounds with no drafts and `decode_len` = k:
the target samples k tokens itself, each from its own row with one draw of the session's
MT19937 stream (none when greedy), stopping early after a stop token. That is exactly k
singleton rounds (docs/design.md §2, D = 0) back to back — the same target rows, the same draws, the same tokens — so
the wire, the WAL commit and the signatures are paid once per k tokens instead of once per
token, and the local lane (which runs the same function) emits the same text.

A round may also name a lookup rule (`RoundRequest.lookup`: min_n, max_n): it then ends
after the first token whose sequence prompt lookup (`muser.lookup`) would extend, as the
proposer's n-gram draft reads it. That is where the local lane would draft its next round,
so the proposer drafts it: the round's tokens are the ones the k singleton rounds would
give, cut where a drafted round would begin. Lookup reads only tokens, never a row or a
draw, so it changes how many tokens a round emits and nothing about any of them.

`decode_batch` runs the decode rounds of several sessions in lockstep: step i of every round
still decoding goes through one forward (`witness_each`), so n sessions' k-token rounds cost
k forwards rather than n × k. Each round's rows, draws and tokens are computed exactly as
`decode_round` computes them alone (a batched forward's rows are those of the backend's
batched path, as for rounds with drafts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from muser.backend import ModelBackend, batches
from muser.lookup import PromptLookup
from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, target_probs
from muser.verify import RoundDecision, judge_round
from verifier_gx.executor import Capture, TargetExecutor, Witness, witness_each


@dataclass(frozen=True)
class Decoded:
    tokens: list[int]
    """The tokens sampled, the last one the round's next frontier."""
    post_state: Mt19937
    logits: np.ndarray
    """The target's raw logits row each token was sampled from, shape (len(tokens), V)."""
    captured: dict[int, np.ndarray] = field(default_factory=dict)
    """A capturing round's rows per layer from its `Capture.first` up to the next frontier
    (each step's forward keeps its own position's; the first also those before it)."""


class _Decoding:
    """One decode round under way: its transcript so far, MT state, tokens and rows."""

    def __init__(
        self,
        executor: TargetExecutor,
        transcript: Sequence[int],
        state: Mt19937,
        decode_len: int,
        params: SamplingParams,
        capture: Capture | None = None,
        lookup: Sequence[int] = (),
    ) -> None:
        if decode_len < 1:
            raise ValueError(f"decode_len must be >= 1, got {decode_len}")
        self.executor, self.decode_len, self.params = executor, decode_len, params
        self.sequence = [int(t) for t in transcript]
        self.lookup = PromptLookup(*lookup, self.sequence) if lookup else None
        self.rng = state
        self.tokens: list[int] = []
        self.rows: list[np.ndarray] = []
        self.capture = capture
        self.captured: dict[int, list[np.ndarray]] = {}

    def witness(self) -> Witness:
        """The next step's forward: the frontier after the sequence, capturing from the
        round's `Capture.first` at the first step and from its own position after."""
        capture = self.capture
        if capture is not None and self.tokens:
            capture = Capture(len(self.sequence) - 1, capture.layers)
        return Witness(self.executor, self.sequence, (), None, capture)

    def step(self, logits: np.ndarray) -> bool:
        """Judge one singleton round on `logits` (the row after the sequence), settle its KV;
        True when the round is complete (decode_len tokens, or a stop token)."""
        p = self.params
        decision = judge_round(
            self.rng, self.sequence[-1], [], [], target_probs(logits, p), greedy=p.greedy
        )
        for layer, rows in self.executor.captured.items():
            self.captured.setdefault(layer, []).append(rows)
        self.executor.settle(len(self.sequence), 0)
        self.rng = decision.post_state
        self.tokens.append(decision.next_frontier)
        self.sequence.append(decision.next_frontier)
        self.rows.append(logits[0])
        if len(self.tokens) == self.decode_len or decision.next_frontier in p.stop_tokens:
            return True
        if self.lookup is None:
            return False
        self.lookup.push(decision.next_frontier)
        return self.lookup.proposal() is not None

    def result(self) -> Decoded:
        captured = {layer: np.concatenate(parts) for layer, parts in self.captured.items()}
        return Decoded(self.tokens, self.rng, np.stack(self.rows), captured)


def decode_round(
    executor: TargetExecutor,
    transcript: Sequence[int],
    state: Mt19937,
    decode_len: int,
    params: SamplingParams,
    lookup: Sequence[int] = (),
) -> Decoded:
    """Sample up to `decode_len` tokens after `transcript` (which ends with the frontier): each
    step is a singleton round (docs/design.md §2) judged by `judge_round`, its KV settled; with a
    `lookup` rule (min_n, max_n), ending after the first token prompt lookup extends."""
    work = [(executor, transcript, state, decode_len, params, None, lookup)]
    (out,) = decode_batch(executor.cursor.backend, work)
    if isinstance(out, Exception):
        raise out
    return out


def decode_batch(
    backend: ModelBackend,
    work: Sequence[tuple],
) -> list[Decoded | Exception]:
    """`decode_round` of each (executor, transcript, state, decode_len, params[, capture[,
    lookup]]), in lockstep:
    one `witness_each` forward per step over the rounds still decoding. A round that fails
    (its forward, its row) gets its exception in its place; the others go on without it.

    Lockstep needs each round on a sequence of its own: on one shared KV (a backend that does
    not batch, a sliding-window model) interleaved steps would re-evaluate every transcript
    at every step, so there the rounds run one after another, each to its end."""
    own = batches(backend) and all(args[0].cursor.backend is not backend for args in work)
    if len(work) > 1 and not own:
        return [decode_batch(backend, [args])[0] for args in work]
    out: list[Decoded | Exception | None] = [None] * len(work)
    rounds: dict[int, _Decoding] = {}
    for i, args in enumerate(work):
        try:
            rounds[i] = _Decoding(*args)
        except ValueError as exc:
            out[i] = exc
    while rounds:
        live = list(rounds)
        steps = [rounds[i].witness() for i in live]
        for i, logits in zip(live, witness_each(backend, steps), strict=True):
            try:
                if isinstance(logits, Exception):
                    raise logits
                done = rounds[i].step(logits)
            except Exception as exc:
                rounds.pop(i).executor.cursor.realign()
                out[i] = exc
                continue
            if done:
                out[i] = rounds.pop(i).result()
    return out  # type: ignore[return-value]


def decode_decision(decoded: Decoded, state: Mt19937) -> RoundDecision:
    """A decode round as the decision the result records: no drafts, the sampled tokens
    before the last, the last as next frontier."""
    draws = decoded.post_state.draws - state.draws
    return RoundDecision(
        0, decoded.tokens[-1], decoded.post_state, draws, tuple(decoded.tokens[:-1])
    )
