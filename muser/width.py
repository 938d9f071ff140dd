"""The draft width D of each round, shared by every lane (adaptive width).

Any D chosen from what is known before a round is lossless: the round's arithmetic holds for
every D (docs/design.md §2), and every request carries its own D, so a width policy changes speed,
never the distribution of the text. It does change *which* uniforms a sampled round uses,
so two lanes emit the same tokens for a seed exactly when they run the same widths
(`ScriptedWidth` replays a recorded schedule for that).

`AdaptiveWidth` picks, before each round, the D in [lo, hi] that maximises expected tokens
per second under the usual model (Leviathan et al. 2023, §3), with the round's fixed costs
split so that a round without drafts can fold several tokens into one trip:

    D > 0:  tokens  E(D) = 1 + α + ... + α^D     seconds  overhead + verify + per_draft × D
    D = 0:  tokens  k = decode_len                seconds  overhead + k × step

α is the per-draft acceptance (accepted over judged drafts: a draft after the first rejection
is never judged), decayed so it follows the text; `overhead` is everything in a round but
the draft and the target (wire, WAL, signatures: ~0 in the local lane); `verify` the target's
work on a round with drafts and `step` its work per decoded token — all measured per session.
D = 0 is the safety mode: when drafting does not pay, rounds carry no drafts and the verifier
decodes `decode_len` tokens per round itself (verifier_gx/decode.py); once `probe_every`
tokens have been decoded so, one round drafts a single token to see whether that changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from muser.round import plan_depth

DECAY = 0.95
"""Weight the acceptance evidence of one round keeps per later round (half-life ≈ 14)."""
COST_SMOOTHING = 0.2
"""Weight of the newest round in the cost averages."""
HYSTERESIS = 1.03
"""A new D must promise this many times the current D's rate before the policy moves."""


def expected_tokens(alpha: float, depth: int) -> float:
    """E(D): tokens one round emits, the next frontier included."""
    return sum(alpha**k for k in range(depth + 1))


class WidthPolicy:
    """Chooses each round's D (and a draftless round's decode_len); told every round's
    outcome. `mode` names it in stats and metrics."""

    mode = "fixed"
    decode_len_max: int = 1

    def choose(self, remaining: int) -> int:
        raise NotImplementedError

    def decode_len(self, remaining: int) -> int:
        """Tokens a round without drafts asks the verifier to decode (never past max_tokens)."""
        return max(1, min(self.decode_len_max, remaining))

    def peek(self, depth: int, remaining: int, accepted: int | None = None) -> int:
        """The D `choose` would return after a round of `depth` drafts, `accepted` of them
        (default all), were observed (costs as they stand): what a next draft made ahead of
        the result should use."""
        return self.choose(remaining)

    def observe(
        self,
        depth: int,
        accepted: int,
        emitted: int,
        *,
        draft_s: float = 0.0,
        verify_s: float = 0.0,
        round_s: float = 0.0,
    ) -> None:
        """A round finished: `depth` drafts, `accepted` of them, `emitted` tokens; `draft_s`
        seconds of drafting on the critical path, `verify_s` of target work, `round_s` from
        the previous round's end to this one's."""

    def restore(self, depth: int, accepted: int, emitted: int) -> None:
        """A round committed before a restart: its outcome counts as evidence, its (unknown)
        timings do not."""

    def to_dict(self) -> dict:
        return {"mode": self.mode}


@dataclass
class FixedWidth(WidthPolicy):
    draft_len: int
    decode_len_max: int = 1

    def __post_init__(self) -> None:
        if self.draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {self.draft_len}")
        if self.decode_len_max < 1:
            raise ValueError(f"decode_len must be >= 1, got {self.decode_len_max}")

    def choose(self, remaining: int) -> int:
        return plan_depth(self.draft_len, remaining)

    def to_dict(self) -> dict:
        out = {"mode": self.mode, "draft_len": self.draft_len}
        if self.draft_len == 0:
            out["decode_len"] = self.decode_len_max
        return out


@dataclass
class ScriptedWidth(WidthPolicy):
    """Replays the widths another run chose (tests: a lane with an adaptive width emits the
    tokens of the local lane run at the same widths; decode_len changes how many rounds, never
    the tokens)."""

    widths: Sequence[int]
    decode_len_max: int = 1
    """What the recorded run's draftless rounds decoded (its lane.decode_len)."""
    _next: int = 0
    mode = "scripted"

    def choose(self, remaining: int) -> int:
        if self._next >= len(self.widths):
            raise ValueError(f"the width script has only {len(self.widths)} rounds")
        return plan_depth(self.widths[self._next], remaining)

    def peek(self, depth: int, remaining: int, accepted: int | None = None) -> int:
        i = self._next + 1
        return plan_depth(self.widths[i], remaining) if i < len(self.widths) else 0

    def observe(self, depth: int, accepted: int, emitted: int, **_: float) -> None:
        self._next += 1


@dataclass
class AdaptiveWidth(WidthPolicy):
    start: int
    lo: int
    hi: int
    decode_len_max: int = 1
    probe_every: int = 16
    """Tokens decoded without drafts between two one-draft probes."""
    judged: float = 2.0
    """Decayed count of judged drafts (prior: two, one accepted)."""
    hits: float = 1.0
    """Decayed count of accepted drafts."""
    overhead_s: float | None = None
    """Seconds of a round besides drafting and the target (wire, WAL, signing), smoothed."""
    verify_s: float | None = None
    """Target seconds of a round with drafts, smoothed."""
    step_s: float | None = None
    """Target seconds per token of a decode round (until one is seen: `verify_s`)."""
    per_draft_s: float | None = None
    """Seconds per drafted token on the critical path, smoothed."""
    current: int = field(init=False)
    undrafted: int = 0
    """Tokens emitted by draftless rounds since the last round with drafts."""
    mode = "adaptive"

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.start <= self.hi:
            raise ValueError(
                f"expected 0 <= lo <= start <= hi, got {self.lo} <= {self.start} <= {self.hi}"
            )
        if self.decode_len_max < 1:
            raise ValueError(f"decode_len must be >= 1, got {self.decode_len_max}")
        self.current = self.start

    @property
    def alpha(self) -> float:
        return self.hits / self.judged

    def _rate(self, alpha: float, depth: int) -> float:
        if depth == 0:
            k = self.decode_len_max
            step = self.step_s if self.step_s is not None else self.verify_s
            return k / (self.overhead_s + k * step)
        cost = self.overhead_s + self.verify_s + self.per_draft_s * depth
        return expected_tokens(alpha, depth) / cost

    def _best(self, alpha: float, probe: bool = True) -> int:
        if probe and self.current == 0 and self.undrafted >= self.probe_every:
            return max(1, self.lo)  # a probe: draftless rounds tell nothing about acceptance
        if None in (self.overhead_s, self.verify_s, self.per_draft_s):
            return self.current  # no costs measured yet: stay where we are
        rates = {d: self._rate(alpha, d) for d in range(self.lo, self.hi + 1)}
        best = max(rates, key=lambda d: (rates[d], -d))
        return best if rates[best] > HYSTERESIS * rates[self.current] else self.current

    def choose(self, remaining: int) -> int:
        return plan_depth(self._best(self.alpha), remaining)

    def peek(self, depth: int, remaining: int, accepted: int | None = None) -> int:
        accepted = depth if accepted is None else accepted
        judged = accepted + (1 if accepted < depth else 0)  # as `restore` counts them
        hits, judged = DECAY * self.hits + accepted, DECAY * self.judged + judged
        return plan_depth(self._best(hits / judged), remaining)

    def restore(self, depth: int, accepted: int, emitted: int) -> None:
        if depth > 0:
            judged = accepted + (1 if accepted < depth else 0)
            self.hits = DECAY * self.hits + accepted
            self.judged = DECAY * self.judged + judged
            self.undrafted = 0
        else:
            self.undrafted += emitted

    def observe(
        self,
        depth: int,
        accepted: int,
        emitted: int,
        *,
        draft_s: float = 0.0,
        verify_s: float = 0.0,
        round_s: float = 0.0,
    ) -> None:
        self.restore(depth, accepted, emitted)
        if depth > 0:
            if draft_s > 0:  # 0: drafted ahead of time (speculation), off the critical path
                self.per_draft_s = _smooth(self.per_draft_s, draft_s / depth)
            self.verify_s = _smooth(self.verify_s, verify_s)
        else:
            self.step_s = _smooth(self.step_s, verify_s / max(1, emitted))
        self.overhead_s = _smooth(self.overhead_s, max(0.0, round_s - draft_s - verify_s))
        self.current = self._best(self.alpha, probe=False)

    def to_dict(self) -> dict:
        def ms(x: float | None) -> float | None:
            return None if x is None else round(1e3 * x, 3)

        return {
            "mode": self.mode,
            "draft_len": self.current,
            "range": [self.lo, self.hi],
            "decode_len": self.decode_len_max,
            "alpha": round(self.alpha, 4),
            "overhead_ms": ms(self.overhead_s),
            "verify_ms": ms(self.verify_s),
            "step_ms": ms(self.step_s),
            "per_draft_ms": ms(self.per_draft_s),
        }


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * new


def width_policy(mode: str, draft_len: int, lo: int, hi: int, decode_len: int = 1) -> WidthPolicy:
    """The policy a lane configures: `fixed` at draft_len, or `adaptive` in [lo, hi] starting
    at draft_len (a range of one value is fixed whatever the mode); draftless rounds ask the
    verifier to decode `decode_len` tokens."""
    if mode not in ("fixed", "adaptive"):
        raise ValueError(f"width mode must be 'fixed' or 'adaptive', got {mode!r}")
    if mode == "fixed" or lo == hi:
        return FixedWidth(draft_len, decode_len)
    return AdaptiveWidth(draft_len, lo, hi, decode_len)
