"""The shape of each tree round (docs/design.md §3), shared by every lane that drafts trees: a
speed policy, like the chain's width (`muser.width`). Any shape chosen before a round is
lossless; a shape that depends on timing changes which uniforms a sampled round uses, so a
seed then pins the distribution of the text rather than the text.

A shape is a *template*: the topology of the fullest tree a round may draft, as parents
(-1 the root), laid out breadth first with siblings in rank order (a node's r-th child is
drawn r-th). `muser.tree.draft_tree` drafts into it: each position gets as many children as
its template node has, fewer where its row's support is smaller. Two families:

- uniform, children per depth (`full_parents`; `shape_for_budget` draws one from a node
  budget): `FixedTree` drafts one every round;
- best first (`best_first`, Sequoia's construction): the n-node template that holds the
  most expected accepted tokens when a child of rank r is the accepted one with probability
  P_r. A weak draft's template is wide at the root and thin below (its second guess beats
  its first guess's child); a strong draft's is deep.

`AdaptiveTree` learns, per session, both the size and the shape: which of a few node
counts emits the most tokens per second — the draftless round (`decode`: the verifier
decodes `decode_len` tokens, a plain step in the local lane), the `chain` of the lane's
depth, and best-first templates of 2, 4 and 7 times the depth and the whole budget — each
template drawn from the acceptance it has measured. Its model:

    a child of rank r (its parent's r-th, 0-based) is tried only once ranks 0..r-1 were
    rejected; beta_r = accepted / tried at rank r, decayed so it follows the text;
    P_r = beta_r (1 - beta_0) ... (1 - beta_{r-1}): the rank-r child is the one accepted;
    a template emits  1 + sum over its nodes of the product of P along the node's path,

all read off the signed results (their topology and accepted path, `rank_outcomes`), and a
size's cost is the smoothed seconds of the rounds drafted at it (each is tried once at the
start; the draftless round's rate is `decode_len` tokens over its own seconds). It moves
only to a size that promises `HYSTERESIS` times the current one's rate, and every
`probe_every` rounds tries the best other size once, so a cost that changed is seen.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from muser.tree import node_depths
from muser.width import COST_SMOOTHING, HYSTERESIS

Template = tuple[int, ...]
"""A tree shape: the parents of the fullest tree a round drafts (the module note)."""

RANKS = 16
"""Child ranks whose acceptance is tracked (wider positions reuse the last one's): a weak
draft's best templates put a dozen or more children at the root."""
RANK_DECAY = 0.99
"""Weight a rank's evidence keeps per later child tried at that rank (half-life ≈ 69
tries): a round tries the first rank at every position it reaches but a later rank at most
once or twice, so a per-round decay (`muser.width.DECAY`) would leave those a handful of
tries to estimate from. At 0.98 the best-first template chased noise in simulated worlds
(down to 86 % of the best template's expected tokens over 6 seeds, against ≥ 99 % at 0.99;
docs/trees.md)."""
DECODE, CHAIN = "decode", "chain"
"""The two sizes that are no best-first template: the draftless round and the chain."""


# --- templates -----------------------------------------------------------------------------


def shape_nodes(branching: Sequence[int]) -> int:
    """Most nodes a uniform tree (children per position at each depth) holds."""
    total, level = 0, 1
    for k in branching:
        level *= k
        total += level
    return total


def full_parents(shape: Sequence[int]) -> Template:
    """The template of the uniform tree of `shape` (children per position at each depth)."""
    parents: list[int] = []
    level = [-1]
    for k in shape:
        deeper = []
        for parent in level:
            for _ in range(k):
                parents.append(parent)
                deeper.append(len(parents) - 1)
        level = deeper
    return tuple(parents)


SHAPE_CAPS = (4, 3, 2)
"""How wide `shape_for_budget` lets each depth grow, root first (2 past the third): the
screen (docs/trees.md) found a wider first level earns most, deeper ones little."""


def shape_for_budget(nodes: int, depth: int) -> list[int]:
    """A uniform shape (children per depth) of at most `nodes` nodes and at most `depth`
    deep: the chain of min(depth, nodes) first, then each depth widened in turn, root first,
    up to its cap in `SHAPE_CAPS`, while the budget holds (16 nodes 4 deep: 4,1,1,1; 28:
    4,2,1,1; 64: 4,3,2,1). A budget of one node is a one-node chain; none, or no depth, is
    no tree."""
    if nodes < 1 or depth < 1:
        return []
    shape = [1] * min(depth, nodes)
    for level in range(len(shape)):
        cap = SHAPE_CAPS[level] if level < len(SHAPE_CAPS) else 2
        while shape[level] < cap:
            shape[level] += 1
            if shape_nodes(shape) > nodes:
                shape[level] -= 1
                break
    return shape


def nodes_per_depth(template: Sequence[int]) -> list[int]:
    """How many nodes the template holds at depth 1, 2, ... (what stats report as its
    shape: 4,1,1,1 children per depth is 4,4,4,4 nodes per depth)."""
    depths = node_depths(template)
    return [depths.count(d) for d in range(1, max(depths, default=0) + 1)]


def cut(template: Sequence[int], depth: int) -> Template:
    """The template's nodes at most `depth` deep (a prefix: it is laid out breadth first)."""
    depths = node_depths(template)
    return tuple(template[: sum(1 for d in depths if d <= depth)])


def most_children(template: Sequence[int]) -> int:
    """The most children any position of the template has (0 for no nodes)."""
    counts: dict[int, int] = {}
    for p in template:
        counts[p] = counts.get(p, 0) + 1
    return max(counts.values(), default=0)


def node_ranks(template: Sequence[int]) -> list[int]:
    """Each node's rank among its siblings (its parent's r-th child, 0-based)."""
    seen: dict[int, int] = {}
    out = []
    for p in template:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def path_values(template: Sequence[int], accept: Sequence[float]) -> list[float]:
    """Each node's chance of lying on the accepted path when the rank-r child is the one
    accepted with probability accept[r] (0 past the list)."""
    values: list[float] = []
    for p, r in zip(template, node_ranks(template), strict=True):
        values.append((values[p] if p >= 0 else 1.0) * (accept[r] if r < len(accept) else 0.0))
    return values


def best_first(accept: Sequence[float], nodes: int, depth: int) -> Template:
    """The template of at most `nodes` nodes, at most `depth` deep, that holds the most
    expected accepted tokens (`path_values`' sum) when the rank-r child is accepted with
    probability accept[r] (0 past the list): grown one node at a time, always the most
    valuable node that may be added next — the first child of a node already in, or the
    next sibling of one — the construction Sequoia (Chen et al. 2024) shows optimal under
    this model when accept falls with rank. Ties go to the node offered first; laid out
    breadth first, siblings by rank."""
    chosen: list[int] = []  # each chosen node's parent: its index in chosen, or -1
    order = itertools.count()
    offers: list[tuple[float, int, int, int, int, float]] = []

    def offer(parent: int, rank: int, at: int, base: float) -> None:
        if at <= depth and rank < len(accept) and accept[rank] > 0:
            value = base * accept[rank]
            heapq.heappush(offers, (-value, next(order), parent, rank, at, base))

    offer(-1, 0, 1, 1.0)
    while offers and len(chosen) < nodes:
        neg, _, parent, rank, at, base = heapq.heappop(offers)
        chosen.append(parent)
        offer(parent, rank + 1, at, base)  # its next sibling
        offer(len(chosen) - 1, 0, at + 1, -neg)  # its first child
    kids: dict[int, list[int]] = {}  # siblings join in rank order (rank r + 1 after r)
    for i, parent in enumerate(chosen):
        kids.setdefault(parent, []).append(i)
    new, parents, queue = {-1: -1}, [], [-1]  # breadth first from the root
    for node in queue:
        for i in kids.get(node, ()):
            new[i] = len(parents)
            parents.append(new[node])
            queue.append(i)
    return tuple(parents)


# --- policies ------------------------------------------------------------------------------


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
    """Chooses each tree round's template; told every round's outcome."""

    mode = "fixed"

    def choose(self, remaining: int) -> Template:
        """The template of the next round, `remaining` tokens from the end (never deeper
        than a round can emit: depth + 1 tokens)."""
        raise NotImplementedError

    def observe(self, parents: Sequence[int], path: Sequence[int], *, round_s: float) -> None:
        """A round of that topology accepted `path` (a draftless round: no parents) in
        `round_s` seconds from the previous round's end."""

    def restore(self, parents: Sequence[int], path: Sequence[int]) -> None:
        """A round committed before a restart: evidence, without its (unknown) timing."""

    def to_dict(self) -> dict:
        return {"mode": self.mode}


@dataclass
class FixedTree(TreePolicy):
    """Every round the uniform tree of `shape` (children per depth)."""

    shape: list[int]

    def __post_init__(self) -> None:
        self.template = full_parents(self.shape)

    def choose(self, remaining: int) -> Template:
        return cut(self.template, remaining - 1)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "shape": nodes_per_depth(self.template),
                "branching": list(self.shape)}  # fmt: skip


Size = int | str
"""A candidate of `AdaptiveTree`: `DECODE`, `CHAIN` or a best-first template's node count."""


def candidate_sizes(budget: int, depth: int) -> list[Size]:
    """The draftless round, the chain of `depth`, and best-first templates of 2, 4 and 7
    times the depth and the whole budget (those above the depth, at most the budget), each
    once, smallest first."""
    out: list[Size] = [DECODE, CHAIN]
    for nodes in sorted({2 * depth, 4 * depth, 7 * depth, budget}):
        nodes = min(nodes, budget)
        if nodes > depth and nodes not in out:
            out.append(nodes)
    return out


@dataclass
class AdaptiveTree(TreePolicy):
    budget: int
    depth: int
    decode_len_max: int = 1
    """Tokens a draftless round emits (the verifier's decode_len; 1 in the local lane)."""
    probe_every: int = 24
    """Rounds between two tries of the best other size."""
    sizes: list[Size] | None = None
    """The candidates (default `candidate_sizes`); one best-first size alone (the tree
    screen's) learns only the shape."""
    tried: list[float] = field(default_factory=lambda: [2.0] * RANKS)
    """Decayed count of children tried at each rank (prior: two, one accepted)."""
    taken: list[float] = field(default_factory=lambda: [1.0] * RANKS)
    cost_s: dict[Size, float] = field(default_factory=dict)
    """Smoothed seconds of a round per size drafted at it."""
    current: Size = field(init=False)
    rounds: int = 0
    mode = "adaptive"

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= self.budget:
            raise ValueError(f"expected 1 <= depth <= budget, got {self.depth} and {self.budget}")
        self.sizes = list(self.sizes or candidate_sizes(self.budget, self.depth))
        bad = [s for s in self.sizes if s not in (DECODE, CHAIN)
               and not (isinstance(s, int) and 1 <= s <= self.budget)]  # fmt: skip
        if bad:
            raise ValueError(f"tree sizes {bad} received; expected {DECODE!r}, {CHAIN!r} or a "
                             f"node count from 1 to the budget {self.budget}")  # fmt: skip
        self.current = self.sizes[-1]
        self.drafted: dict[Template, Size] = {}
        """The templates handed out lately, and their sizes (a round's cost goes to its
        size; drafting ahead chooses before the last round is observed)."""

    def beta(self, rank: int) -> float:
        r = min(rank, RANKS - 1)
        return self.taken[r] / self.tried[r]

    def accept(self, ranks: int) -> list[float]:
        """P_r for r < `ranks`: the rank-r child is the one accepted (the module note)."""
        out, miss = [], 1.0
        for r in range(ranks):
            out.append(miss * self.beta(r))
            miss *= 1.0 - self.beta(r)
        return out

    def template(self, size: Size, accept: list[float] | None = None) -> Template:
        """The template of `size` under `accept` (default: `self.accept(size)`; a longer
        list draws the same: a rank-r child needs r siblings before it)."""
        if size == DECODE:
            return ()
        if size == CHAIN:
            return full_parents([1] * self.depth)
        return best_first(accept or self.accept(size), size, self.depth)

    def expected_tokens(self, template: Sequence[int], accept: list[float] | None = None) -> float:
        """Tokens a round of `template` emits under the model (the module note)."""
        if not template:
            return float(self.decode_len_max)
        return 1.0 + sum(path_values(template, accept or self.accept(len(template))))

    def _rates(self) -> dict[Size, float]:
        """Every candidate's tokens per second, read off one estimate of the acceptance."""
        accept = self.accept(self.budget)
        return {
            s: self.expected_tokens(self.template(s, accept), accept) / self.cost_s[s]
            for s in self.sizes
        }

    def _nodes(self, size: Size) -> int:
        return 0 if size == DECODE else self.depth if size == CHAIN else int(size)

    def _best(self) -> Size:
        """The size of the next round: each candidate once first (smallest first), then
        every `probe_every` rounds the best other one once, else where it sits."""
        untried = [s for s in self.sizes if s not in self.cost_s]
        if untried:
            return untried[0]
        if len(self.sizes) > 1 and self.rounds % self.probe_every == 0:
            rates = self._rates()
            return max((s for s in self.sizes if s != self.current), key=rates.__getitem__)
        return self.current

    def _settle(self) -> Size:
        """Where it sits after a round: the best rate, once it beats the current one's by
        `HYSTERESIS` (the current one until every candidate has a cost)."""
        if any(s not in self.cost_s for s in self.sizes):
            return self.current
        rates = self._rates()
        best = max(self.sizes, key=lambda s: (rates[s], -self._nodes(s)))
        return best if rates[best] > HYSTERESIS * rates[self.current] else self.current

    def choose(self, remaining: int) -> Template:
        size = self._best()
        template = self.template(size)
        if len(self.drafted) > 64:
            self.drafted.clear()
        self.drafted[template] = size
        return cut(template, remaining - 1)

    def restore(self, parents: Sequence[int], path: Sequence[int]) -> None:
        for rank, accepted in rank_outcomes(parents, path) if parents else ():
            r = min(rank, RANKS - 1)  # each rank's evidence decays as that rank is tried
            self.tried[r] = RANK_DECAY * self.tried[r] + 1
            self.taken[r] = RANK_DECAY * self.taken[r] + accepted

    def observe(self, parents: Sequence[int], path: Sequence[int], *, round_s: float) -> None:
        self.restore(parents, path)
        size = self.drafted.get(tuple(parents)) if parents else DECODE
        if size is not None and round_s > 0:  # (None: a template cut short near the end)
            old = self.cost_s.get(size)
            smoothed = (1 - COST_SMOOTHING) * old + COST_SMOOTHING * round_s if old else round_s
            self.cost_s[size] = smoothed
        self.rounds += 1
        self.current = self._settle()

    def to_dict(self) -> dict:
        template = self.template(self.current)
        return {
            "mode": self.mode,
            "shape": nodes_per_depth(template),
            "nodes": len(template),
            "size": self.current,
            "budget": self.budget,
            "depth": self.depth,
            "acceptance_by_rank": [round(self.beta(r), 4) for r in range(4)],
            "round_ms": {str(s): round(1e3 * c, 3) for s, c in self.cost_s.items()},
        }


def tree_policy(mode: str, budget: int, depth: int, decode_len: int = 1) -> TreePolicy:
    """A lane's tree policy: `fixed` drafts `shape_for_budget(budget, depth)` every round,
    `adaptive` learns its size and shape (`AdaptiveTree`; lane.width)."""
    if mode == "adaptive":
        return AdaptiveTree(budget, depth, decode_len)
    return FixedTree(shape_for_budget(budget, depth))
