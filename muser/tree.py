"""Drafting and judging one tree round (docs/design.md §3). Pure: a topology, rows and an MT
state in, a decision out.

A tree of N draft nodes. Node i carries a token and a parent: -1 for the root (the
frontier), else an earlier node, so a node's ancestors all come before it and neither a
cycle nor an orphan can be written. Positions name where a row sits: position 0 is the
root, position i + 1 is node i (the end of the path root -> ... -> node i). Each position
with children carries the sparse draft row q its children were drawn from (None where it
has none); the witness rows p_0..p_N are the target's rows at the N + 1 positions, so p_v
judges the children of position v, and p_v of a position without children yields the bonus.
A chain (parents -1, 0, 1, ...) is the linear round: it draws and decides exactly as
`muser.verify.judge_round`, bit for bit.

Draw order within a round, and nothing else consumes:
  1. proposer, drafting (`draft_tree`): positions in order 0..N; at each, its children in
     node order, one uniform per child, each drawn from the position's q without
     replacement: child j = sample_ordered(q with children 1..j-1 zeroed, u). Node indices
     follow from this order (breadth first: a position's children are appended as it is
     expanded). Greedy: a position's children are its q's largest weights, descending
     (lowest id first among equals), and nothing is drawn.
  2. verifier, judging from the root: at position v with children x_1..x_k (node order),
     p' = p_v and q' = q_v normalised. For each child in turn: one uniform u; accept iff
     p'(x) > 0 and u < p'(x) / q'(x), and go on at that child's position. On rejection
     p' <- norm(max(p' - q', 0)) (p' kept when that is all zero, as the linear round keeps
     p_a), q'(x) <- 0 and q' is renormalised: recursive rejection sampling without
     replacement (SpecTr, Sequoia), lossless at any temperature.
  3. one uniform: the next frontier sampled from p' when every child of v was rejected, or
     from p_v (the bonus) at a position without children.
Greedy: rows are one-hot argmax (lowest id on ties): a child is accepted iff it is p_v's
argmax, and the next frontier is p_v's argmax; nothing is drawn. The accepted path is the
target's greedy path.

`judge_tree` is the fast path (numpy over the vocabulary); `judge_tree_reference` the slow
float64 reference as plain loops. Tests hold them equal under the same draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from muser.errors import (
    DraftMismatchError,
    DraftZeroProbabilityError,
    RowCountError,
    TokenOutOfVocabularyError,
    TreeTopologyError,
)
from muser.mt19937 import Mt19937
from muser.sampling import SparseRow, argmax_lowest, check_probability_rows, sample_ordered
from muser.verify import argmax_reference, check_geometry, sample_ordered_reference


def branching_positions(parents: Sequence[int]) -> list[int]:
    """The positions (0: the root, i + 1: node i) some node names as its parent, ascending."""
    return sorted({int(p) + 1 for p in parents if -1 <= int(p) < len(parents)})


@dataclass(frozen=True)
class Tree:
    """What a tree round drafts: per node its parent (-1: the root) and token, and per
    position (0: the root, i + 1: node i) the q row its children were drawn from."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    q_rows: tuple[SparseRow | None, ...]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self, position: int) -> list[int]:
        """The nodes whose parent is `position` (0: the root), in node order."""
        parent = position - 1
        return [i for i, p in enumerate(self.parents) if p == parent]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def branching_positions(self) -> list[int]:
        """The positions with children, ascending: those that carry a draft row."""
        return branching_positions(self.parents)

    def wire_rows(self) -> tuple[SparseRow, ...]:
        """The draft rows as a request carries them: one per position with children, in
        position order (a position without children has none to send)."""
        return tuple(self.q_rows[v] for v in self.branching_positions())  # type: ignore[misc]

    @classmethod
    def from_wire(
        cls, parents: Sequence[int], tokens: Sequence[int], rows: Sequence[SparseRow]
    ) -> Tree:
        """A tree from a request's topology, node tokens and `wire_rows`; refused when the
        rows are not one per position with children (topology checks: `validate_request`)."""
        positions = branching_positions(parents)
        if len(rows) != len(positions):
            raise RowCountError(
                f"a tree whose positions {positions} have children needs {len(positions)} "
                f"draft rows, got {len(rows)}"
            )
        at = dict(zip(positions, rows, strict=True))
        return cls(
            tuple(int(p) for p in parents),
            tuple(int(t) for t in tokens),
            tuple(at.get(v) for v in range(len(tokens) + 1)),
        )

    @classmethod
    def chain(cls, drafts: Sequence[int], q_rows: Sequence[SparseRow]) -> Tree:
        """The linear round's drafts as a one-branch tree (the last position has no row)."""
        n = len(drafts)
        return cls(tuple(range(-1, n - 1)), tuple(int(d) for d in drafts), (*q_rows, None))


@dataclass(frozen=True)
class TreeDecision:
    path: tuple[int, ...]
    """The accepted nodes, root's child first."""
    next_frontier: int
    post_state: Mt19937
    draws: int
    """uniform_f64 draws the round consumed (drafting replay + judging)."""

    def emitted(self, tree: Tree) -> list[int]:
        """Tokens the round emits: the accepted path's tokens, then the next frontier."""
        return [*(tree.tokens[i] for i in self.path), self.next_frontier]

    @property
    def accepted(self) -> int:
        return len(self.path)


def check_topology(parents: Sequence[int], n: int, max_nodes: int) -> None:
    """`parents` is a topology of `n` nodes a round can carry: 1 to `max_nodes` nodes, each
    parent the root (-1) or an earlier node (so no cycle and no orphan can be written)."""
    if len(parents) != n:
        raise TreeTopologyError(f"{n} tree tokens need {n} parents, got {len(parents)}")
    if not 1 <= n <= max_nodes:
        raise TreeTopologyError(f"a tree has 1 to {max_nodes} nodes (the node budget), got {n}")
    for i, parent in enumerate(parents):
        if not -1 <= parent < n:
            raise TreeTopologyError(
                f"node {i}: parent {parent} is no node (an orphan); expected -1 (the root) or "
                f"an earlier node in [0, {i})"
            )
        if parent >= i:
            raise TreeTopologyError(
                f"node {i}: parent {parent} is not an earlier node; parents come before their "
                "children, so a tree has no cycle"
            )


def check_path(parents: Sequence[int], path: Sequence[int]) -> None:
    """`path` is an accepted path of the topology: the root's child first, each node the
    child of the one before."""
    above = -1
    for node in path:
        if not 0 <= node < len(parents) or parents[node] != above:
            raise TreeTopologyError(
                f"accepted path {list(path)}: node {node} is not a child of "
                f"{'the root' if above < 0 else f'node {above}'}"
            )
        above = node


def tree_draws(parents: Sequence[int], path: Sequence[int], greedy: bool) -> int:
    """uniform_f64 draws a tree round consumes (the module note's order): one a node while
    drafting; judging, at each position of the path one a child tried up to the one taken,
    at the last position one a child (all rejected), then one for the next frontier. None
    when greedy. `path` must be a path of `parents` (`check_path`)."""
    if greedy:
        return 0
    draws, position = len(parents), 0
    for node in path:
        kids = [i for i, p in enumerate(parents) if p == position - 1]
        draws += kids.index(node) + 1
        position = node + 1
    return draws + sum(1 for p in parents if p == position - 1) + 1


def validate_request(frontier: int, tree: Tree, vocab_size: int, max_nodes: int) -> None:
    """Every topology and draft-row check a tree round's request can be refused on, before
    its witness rows exist and before a single draw."""
    n = tree.size
    check_topology(tree.parents, n, max_nodes)
    if len(tree.q_rows) != n + 1:
        raise RowCountError(f"{n} nodes need {n + 1} draft rows (one per position), got "
                            f"{len(tree.q_rows)}")  # fmt: skip
    for what, token in [("frontier", frontier)] + [
        (f"node {i}", t) for i, t in enumerate(tree.tokens)
    ]:
        if not 0 <= int(token) < vocab_size:
            raise TokenOutOfVocabularyError(
                f"{what} token {token} outside the vocabulary [0, {vocab_size})"
            )
    for position, row in enumerate(tree.q_rows):
        kids = tree.children(position)
        if not kids:
            if row is not None:
                raise TreeTopologyError(f"position {position} has a draft row and no children")
            continue
        if row is None:
            raise RowCountError(f"position {position} has children and no draft row")
        row.validate(vocab_size, f"draft row at position {position}")
        seen: set[int] = set()
        for i in kids:
            token = int(tree.tokens[i])
            if token in seen:
                raise TreeTopologyError(
                    f"node {i}: token {token} twice among the children of position {position} "
                    "(siblings are drawn without replacement)"
                )
            seen.add(token)
            if row.probability(token) <= 0.0:
                raise DraftZeroProbabilityError(
                    f"node {i} token {token} has draft probability q = 0 in its row"
                )


def validate_tree(
    frontier: int, tree: Tree, witness: np.ndarray, vocab_size: int, max_nodes: int
) -> None:
    """Every topology, geometry and value check, before a single draw."""
    validate_request(frontier, tree, vocab_size, max_nodes)
    tokens = [("frontier", frontier)] + [(f"node {i}", t) for i, t in enumerate(tree.tokens)]
    check_geometry(witness, tree.size + 1, f"{tree.size} nodes", vocab_size, tokens)
    check_probability_rows(witness, "witness")


# --- depths --------------------------------------------------------------------------------


def node_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (the root's children are at depth 1)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 + (depths[p] if p >= 0 else 0))
    return depths


def tree_depth(parents: Sequence[int]) -> int:
    """The deepest node's depth: the most drafts one path of the tree can accept."""
    return max(node_depths(parents), default=0)


def tree_depths(parents: Sequence[int], width: int) -> list[int]:
    """Depth of each block entry (0: the root) of a tree with `width` entries (root and
    nodes); refuses parents that are not -1 or an earlier node."""
    if len(parents) != width - 1:
        raise ValueError(f"a tree of {width} tokens (root and nodes) has {width - 1} parents, "
                         f"got {len(parents)}")  # fmt: skip
    depths = [0]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}: parent {parent} is not -1 (the root) or an earlier node")
        depths.append(depths[parent + 1] + 1)
    return depths


# --- drafting ------------------------------------------------------------------------------


def greedy_order(row: SparseRow, k: int) -> list[int]:
    """The row's `k` first ids by weight, descending, lowest id first among equals."""
    order = np.lexsort((row.ids, -row.weights))[:k]
    return [int(i) for i in row.ids[order]]


def draw_children(row: SparseRow, k: int, rng: Mt19937, greedy: bool) -> list[int]:
    """Up to `k` distinct tokens from `row` (fewer when its support is smaller): greedy, its
    k largest; else k draws without replacement, one uniform each."""
    k = min(k, int(np.count_nonzero(row.weights)))
    if greedy:
        return greedy_order(row, k)
    weights = row.weights.astype(np.float64).copy()
    out = []
    for _ in range(k):
        j = sample_ordered(weights, rng.uniform_f64())
        out.append(int(row.ids[j]))
        weights[j] = 0.0
    return out


RowsAt = Callable[[list[int], list[int], list[int]], list[SparseRow]]
"""rows_at(parents, tokens, positions): the draft rows at `positions` (all of one depth, in
order) of the tree drafted so far (its nodes' parents and tokens)."""


def draft_tree(rng: Mt19937, template: Sequence[int], rows_at: RowsAt, greedy: bool) -> Tree:
    """Draft a tree into `template` (a shape: the parents of the fullest tree, laid out
    breadth first, siblings in rank order; `muser.tree_width`) breadth first, one depth at a
    time: a position gets as many children, drawn from its row, as its template node has
    (fewer where the row's support is smaller; none under a node the tree did not get). One
    `rows_at` call a depth, for the positions that get children, so a draft can evaluate a
    whole depth in one forward. `rng` advances by the drafting draws, in the module note's
    order (positions of one depth come before the next depth's)."""
    kids: dict[int, list[int]] = {}  # template position -> its children's template nodes
    for node, parent in enumerate(template):
        kids.setdefault(parent + 1, []).append(node)
    parents: list[int] = []
    tokens: list[int] = []
    rows: dict[int, SparseRow] = {}
    level = [(0, 0)]  # (position in the tree, position in the template)
    while level:
        level = [(v, t) for v, t in level if t in kids]
        if not level:
            break
        deeper = []
        got = rows_at(parents, tokens, [v for v, _ in level])
        for (position, t), row in zip(level, got, strict=True):
            rows[position] = row
            drawn = draw_children(row, len(kids[t]), rng, greedy)
            for token, node in zip(drawn, kids[t], strict=False):
                parents.append(position - 1)
                tokens.append(token)
                deeper.append((len(tokens), node + 1))
        level = deeper
    return Tree(tuple(parents), tuple(tokens), tuple(rows.get(v) for v in range(len(tokens) + 1)))


def per_path(row_at: Callable[[list[int]], SparseRow]) -> RowsAt:
    """`rows_at` from a function of one position's path tokens (root's child first)."""

    def rows_at(parents: list[int], tokens: list[int], positions: list[int]) -> list[SparseRow]:
        out = []
        for position in positions:
            path, node = [], position - 1
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            out.append(row_at(path[::-1]))
        return out

    return rows_at


def replay_tree(state: Mt19937, tree: Tree, greedy: bool) -> Mt19937:
    """Step 1 replayed: refuse a tree the draws from `state` would not have selected.
    Returns the state after drafting; `state` itself is not advanced."""
    rng = state.copy()
    for position, row in enumerate(tree.q_rows):
        kids = tree.children(position)
        if not kids:
            continue
        expected = draw_children(row, len(kids), rng, greedy)
        for i, want in zip(kids, expected, strict=False):
            if want != int(tree.tokens[i]):
                raise DraftMismatchError(
                    f"node {i}: the replayed draw at position {position} selects token {want}, "
                    f"the request declares {int(tree.tokens[i])}"
                )
    return rng


# --- judging -------------------------------------------------------------------------------


Step = Callable[[int, list[int]], tuple[int | None, int]]
"""step(position, its children) -> (the child taken, -1) or (None, the next frontier)."""


def _walk(tree: Tree, rng: Mt19937, start: int, step: Step) -> TreeDecision:
    """From the root, one `step` a position, until one gives the next frontier."""
    path: list[int] = []
    position = 0
    while True:
        taken, token = step(position, tree.children(position))
        if taken is None:
            return TreeDecision(tuple(path), token, rng, rng.draws - start)
        path.append(taken)
        position = taken + 1


def _greedy_step(tree: Tree, kids: list[int], best: int) -> tuple[int | None, int]:
    """Greedy: the child that is the target's argmax `best`, else `best` ends the round."""
    taken = next((i for i in kids if int(tree.tokens[i]) == best), None)
    return (taken, -1) if taken is not None else (None, best)


def judge_tree(
    state: Mt19937,
    frontier: int,
    tree: Tree,
    witness: np.ndarray,
    *,
    greedy: bool,
    max_nodes: int,
) -> TreeDecision:
    """Validate, replay the drafting draws, then walk the tree from the root."""
    vocab = witness.shape[-1] if witness.ndim == 2 else 0
    validate_tree(frontier, tree, witness, vocab, max_nodes)
    start = state.draws
    rng = replay_tree(state, tree, greedy)

    def step(position: int, kids: list[int]) -> tuple[int | None, int]:
        p = witness[position]
        if greedy:
            return _greedy_step(tree, kids, argmax_lowest(p))
        last, q = p, tree.q_rows[position].dense(vocab) if kids else None
        for i in kids:
            x = int(tree.tokens[i])
            u = rng.uniform_f64()
            if p[x] > 0.0 and u < p[x] / q[x]:  # a token with p = 0 is never accepted
                return i, -1
            residual = np.maximum(p - q, 0.0)
            if np.any(residual > 0.0):
                p, last = residual / np.cumsum(residual)[-1], residual
            q = q.copy()
            q[x] = 0.0
            z = np.cumsum(q)[-1]
            if z > 0.0:
                q = q / z
        # every child rejected: the next frontier from the residual; no child: the bonus
        return None, sample_ordered(last, rng.uniform_f64())

    return _walk(tree, rng, start, step)


# --- the slow float64 reference ------------------------------------------------------------


def _total(values: list[float]) -> float:
    total = 0.0
    for v in values:
        total += v
    return total


def judge_tree_reference(
    state: Mt19937,
    frontier: int,
    tree: Tree,
    witness: np.ndarray,
    *,
    greedy: bool,
    max_nodes: int,
) -> TreeDecision:
    """The same algorithm as `judge_tree` (drafting replay included), as plain float64
    loops over Python lists."""
    vocab = witness.shape[-1] if witness.ndim == 2 else 0
    validate_tree(frontier, tree, witness, vocab, max_nodes)
    rng = state.copy()
    start = rng.draws
    dense: list[list[float] | None] = []
    for position, row in enumerate(tree.q_rows):
        kids = [i for i, parent in enumerate(tree.parents) if parent == position - 1]
        if row is None:
            dense.append(None)
            continue
        ids, weights = [int(t) for t in row.ids], [float(w) for w in row.weights]
        left = list(weights)
        for i in kids:
            if greedy:
                ranked = sorted(range(len(ids)), key=lambda j: (-weights[j], ids[j]))
                pick = ranked[kids.index(i)]
            else:
                pick = sample_ordered_reference(left, rng.uniform_f64())
                left[pick] = 0.0
            if ids[pick] != int(tree.tokens[i]):
                raise DraftMismatchError(
                    f"node {i}: the replayed draw at position {position} selects token "
                    f"{ids[pick]}, the request declares {int(tree.tokens[i])}"
                )
        z = _total(weights)
        row_dense = [0.0] * vocab
        for t, w in zip(ids, weights, strict=True):
            row_dense[t] = w / z
        dense.append(row_dense)
    rows = [[float(v) for v in r] for r in witness]

    def step(position: int, kids: list[int]) -> tuple[int | None, int]:
        p = rows[position]
        if greedy:
            return _greedy_step(tree, kids, argmax_reference(p))
        last, q = p, list(dense[position]) if kids else []
        for i in kids:
            x = int(tree.tokens[i])
            u = rng.uniform_f64()
            if p[x] > 0.0 and u < p[x] / q[x]:
                return i, -1
            residual = [max(pv - qv, 0.0) for pv, qv in zip(p, q, strict=True)]
            if any(r > 0.0 for r in residual):
                z = _total(residual)
                p, last = [r / z for r in residual], residual
            q[x] = 0.0
            z = _total(q)
            if z > 0.0:
                q = [v / z for v in q]
        return None, sample_ordered_reference(last, rng.uniform_f64())

    return _walk(tree, rng, start, step)
