"""The shape of each tree round (DESIGN.md §4.1), shared by every lane that drafts trees: a
speed policy, like the chain's width (`muser.width`). Any shape chosen before a round is
lossless; a shape that depends on timing changes which uniforms a sampled round uses, so a
seed then pins the distribution of the text rather than the text.

`FixedTree` drafts one shape (`muser.tree.shape_for_budget` of the node budget).
`AdaptiveTree` learns, per session, which of a few candidate shapes emits the most tokens
per second: the draftless round (`[]`: the verifier decodes `decode_len` tokens, a plain
step in the local lane), the chain of the lane's depth, and the budget's shapes at 2, 4 and
7 times the depth and the whole budget. Its model:

    a child of rank r (its parent's r-th, 0-based) is tried only once ranks 0..r-1 were
    rejected; beta_r = accepted / tried at rank r, decayed so it follows the text;
    a position with k children passes with  a(k) = 1 - (1 - beta_0) ... (1 - beta_{k-1});
    a shape (k_1, ..., k_D) emits  1 + sum_d prod_{j<=d} a(k_j)  tokens a round,

all read off the signed results (their topology and accepted path, `rank_outcomes`), and its
cost is the smoothed seconds of the rounds drafted in it (each candidate is tried once at
the start; the draftless round's rate is `decode_len` tokens over its own seconds). It moves
only to a shape that promises `HYSTERESIS` times the current one's rate, and every
`probe_every` rounds tries the best other shape once, so a cost that changed is seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from muser.tree import full_parents, shape_for_budget, shape_nodes
from muser.width import COST_SMOOTHING, HYSTERESIS

RANKS = 8
"""Child ranks whose acceptance is tracked (wider positions reuse the last one's)."""
RANK_DECAY = 0.98
"""Weight a rank's evidence keeps per later child tried at that rank (half-life ≈ 35
tries): a round tries the first rank at every position it reaches but a later rank at most
once or twice, so a per-round decay (`muser.width.DECAY`) would leave those a handful of
tries to estimate from."""


def rank_outcomes(parents: Sequence[int], path: Sequence[int]) -> list[tuple[int, bool]]:
    """(rank, accepted) of every child a tree round's judging tried: at each position of the
    accepted path its children in node order up to the one taken, at its last position every
    child (all rejected). A chain's round is the one-child case."""
    out: list[tuple[int, bool]] = []
    position = 0
    for node in [*path, None]:
        kids = [i for i, p in enumerate(parents) if p == position - 1]
        taken = kids.index(node) if node is not None else len(kids)
        out += [(r, False) for r in range(taken)]
        if node is None:
            break
        out.append((taken, True))
        position = node + 1
    return out


class TreePolicy:
    """Chooses each tree round's shape; told every round's outcome."""

    mode = "fixed"

    def choose(self, remaining: int) -> list[int]:
        raise NotImplementedError

    def observe(self, parents: Sequence[int], path: Sequence[int], *, round_s: float) -> None:
        """A round of that topology accepted `path` (a draftless round: no parents) in
        `round_s` seconds from the previous round's end."""

    def restore(self, parents: Sequence[int], path: Sequence[int]) -> None:
        """A round committed before a restart: evidence, without its (unknown) timing."""

    def to_dict(self) -> dict:
        return {"mode": self.mode}


def _cut(shape: Sequence[int], remaining: int) -> list[int]:
    """A round emits at most depth + 1 tokens: never deeper than what is left."""
    return list(shape[: max(0, remaining - 1)])


@dataclass
class FixedTree(TreePolicy):
    shape: list[int]

    def choose(self, remaining: int) -> list[int]:
        return _cut(self.shape, remaining)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "shape": list(self.shape)}


def candidate_shapes(budget: int, depth: int) -> list[list[int]]:
    """The draftless round, the chain of `depth` and the budget's shapes at 2, 4 and 7 times
    the depth and the whole budget (`shape_for_budget`), each once, smallest first."""
    out: list[list[int]] = [[]]
    for nodes in sorted({depth, 2 * depth, 4 * depth, 7 * depth, budget}):
        shape = shape_for_budget(min(nodes, budget), depth)
        if shape and shape not in out:
            out.append(shape)
    return out


@dataclass
class AdaptiveTree(TreePolicy):
    budget: int
    depth: int
    decode_len_max: int = 1
    """Tokens a draftless round emits (the verifier's decode_len; 1 in the local lane)."""
    probe_every: int = 24
    """Rounds between two tries of the best other shape."""
    tried: list[float] = field(default_factory=lambda: [2.0] * RANKS)
    """Decayed count of children tried at each rank (prior: two, one accepted)."""
    taken: list[float] = field(default_factory=lambda: [1.0] * RANKS)
    cost_s: dict[tuple[int, ...], float] = field(default_factory=dict)
    """Smoothed seconds of a round per shape drafted in it."""
    current: tuple[int, ...] = field(init=False)
    rounds: int = 0
    mode = "adaptive"

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= self.budget:
            raise ValueError(f"expected 1 <= depth <= budget, got {self.depth} and {self.budget}")
        self.shapes = [tuple(s) for s in candidate_shapes(self.budget, self.depth)]
        self.current = tuple(shape_for_budget(self.budget, self.depth))

    def beta(self, rank: int) -> float:
        r = min(rank, RANKS - 1)
        return self.taken[r] / self.tried[r]

    def expected_tokens(self, shape: Sequence[int]) -> float:
        """Tokens a round of `shape` emits under the model (the module note)."""
        if not shape:
            return float(self.decode_len_max)
        total, reach = 1.0, 1.0
        for k in shape:
            miss = 1.0
            for r in range(k):
                miss *= 1.0 - self.beta(r)
            reach *= 1.0 - miss
            total += reach
        return total

    def _rate(self, shape: tuple[int, ...]) -> float:
        return self.expected_tokens(shape) / self.cost_s[shape]

    def _best(self) -> tuple[int, ...]:
        """The shape of the next round: each candidate once first (smallest first), then
        every `probe_every` rounds the best other one once, else where it sits."""
        untried = [s for s in self.shapes if s not in self.cost_s]
        if untried:
            return untried[0]
        if self.rounds % self.probe_every == 0:
            return max((s for s in self.shapes if s != self.current), key=self._rate)
        return self.current

    def _settle(self) -> tuple[int, ...]:
        """Where it sits after a round: the best rate, once it beats the current one's by
        `HYSTERESIS` (the current one until every candidate has a cost)."""
        if any(s not in self.cost_s for s in self.shapes):
            return self.current
        best = max(self.shapes, key=lambda s: (self._rate(s), -shape_nodes(s)))
        if self._rate(best) > HYSTERESIS * self._rate(self.current):
            return best
        return self.current

    def choose(self, remaining: int) -> list[int]:
        return _cut(self._best(), remaining)

    def restore(self, parents: Sequence[int], path: Sequence[int]) -> None:
        for rank, accepted in rank_outcomes(parents, path) if parents else ():
            r = min(rank, RANKS - 1)  # each rank's evidence decays as that rank is tried
            self.tried[r] = RANK_DECAY * self.tried[r] + 1
            self.taken[r] = RANK_DECAY * self.taken[r] + accepted

    def observe(self, parents: Sequence[int], path: Sequence[int], *, round_s: float) -> None:
        self.restore(parents, path)
        shape = self._shape_of(parents)
        if shape is not None and round_s > 0:
            old = self.cost_s.get(shape)
            smoothed = (1 - COST_SMOOTHING) * old + COST_SMOOTHING * round_s if old else round_s
            self.cost_s[shape] = smoothed
        self.rounds += 1
        self.current = self._settle()

    def _shape_of(self, parents: Sequence[int]) -> tuple[int, ...] | None:
        """The candidate a round was drafted in (None: a shape cut short near the end)."""
        if not parents:
            return ()
        return next((s for s in self.shapes if s and full_parents(s) == tuple(parents)), None)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "shape": list(self.current),
            "budget": self.budget,
            "depth": self.depth,
            "acceptance_by_rank": [round(self.beta(r), 4) for r in range(4)],
            "round_ms": {
                ",".join(map(str, s)) or "decode": round(1e3 * c, 3) for s, c in self.cost_s.items()
            },
        }


def tree_policy(mode: str, budget: int, depth: int, decode_len: int = 1) -> TreePolicy:
    """A lane's tree policy: `fixed` drafts `shape_for_budget(budget, depth)` every round,
    `adaptive` learns among `candidate_shapes` (lane.width)."""
    if mode == "adaptive":
        return AdaptiveTree(budget, depth, decode_len)
    return FixedTree(shape_for_budget(budget, depth))
