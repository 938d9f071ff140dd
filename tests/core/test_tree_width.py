"""Tree shapes and the policy that picks them (muser.tree_width): uniform shapes from a
budget, best-first templates (the most expected tokens for their node count, checked against
every tree there is), rank outcomes read off a result's topology and path, the
expected-tokens model (a chain's is the chain width's own), and an adaptive policy that
settles on the size with the best true rate when nodes are cheap (a GPU's flat forward) and
when they are dear (this CPU's), drawing wide templates for a weak draft and deep ones for a
strong one."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muser.tree_width import (
    CHAIN,
    DECODE,
    AdaptiveTree,
    FixedTree,
    best_first,
    candidate_sizes,
    cut,
    full_parents,
    most_children,
    node_ranks,
    nodes_per_depth,
    path_values,
    rank_outcomes,
    shape_for_budget,
    shape_nodes,
    tree_policy,
)
from muser.width import expected_tokens

#      root
#     /  |  \
#    0   1   2
#   / \      |
#  3   4     5
PARENTS = (-1, -1, -1, 0, 0, 2)


def test_rank_outcomes_read_what_the_judge_tried():
    assert rank_outcomes(PARENTS, ()) == [(0, False), (1, False), (2, False)]
    assert rank_outcomes(PARENTS, (0,)) == [(0, True), (0, False), (1, False)]
    assert rank_outcomes(PARENTS, (2, 5)) == [(0, False), (1, False), (2, True), (0, True)]
    assert rank_outcomes(PARENTS, (0, 4)) == [(0, True), (0, False), (1, True)]
    chain = (-1, 0, 1)
    assert rank_outcomes(chain, (0, 1)) == [(0, True), (0, True), (0, False)]


def test_a_chains_expected_tokens_are_the_chain_width_models():
    policy = AdaptiveTree(budget=16, depth=4)
    policy.taken[0], policy.tried[0] = 3.0, 10.0
    chain = full_parents([1, 1, 1, 1])
    assert policy.expected_tokens(chain) == pytest.approx(expected_tokens(0.3, 4))
    assert policy.expected_tokens(()) == 1.0  # the local lane's plain step
    assert AdaptiveTree(16, 4, decode_len_max=8).expected_tokens(()) == 8.0
    # a second child at the root raises what the first position passes
    policy.taken[1], policy.tried[1] = 2.0, 10.0
    one, two = (
        policy.expected_tokens(full_parents([1, 1])),
        policy.expected_tokens(full_parents([2, 1])),
    )
    assert two == pytest.approx(1 + (1 - 0.7 * 0.8) * (1 + 0.3)) and two > one


def test_candidates_and_the_fixed_shape():
    assert candidate_sizes(16, 4) == [DECODE, CHAIN, 8, 16]
    assert candidate_sizes(64, 4) == [DECODE, CHAIN, 8, 16, 28, 64]
    assert candidate_sizes(4, 4) == [DECODE, CHAIN]
    fixed = tree_policy("fixed", 16, 4)
    assert isinstance(fixed, FixedTree) and fixed.choose(100) == full_parents([4, 1, 1, 1])
    assert fixed.choose(3) == full_parents([4, 1])  # never deeper than what is left
    assert fixed.to_dict() == {"mode": "fixed", "shape": [4, 4, 4, 4], "branching": [4, 1, 1, 1]}
    assert isinstance(tree_policy("adaptive", 16, 4), AdaptiveTree)
    with pytest.raises(ValueError, match="expected 1 <= depth <= budget"):
        AdaptiveTree(budget=2, depth=4)
    with pytest.raises(ValueError, match=r"tree sizes \[0, 99\] received; expected .* budget 16"):
        AdaptiveTree(budget=16, depth=4, sizes=[0, 8, 99])


def judged(template, betas, rng):
    """A round of `template` judged in a world where rank r accepts with betas[r]."""
    path, position = [], -1
    while True:
        kids = [i for i, p in enumerate(template) if p == position]
        taken = next(
            (i for r, i in enumerate(kids) if rng.random() < betas[min(r, len(betas) - 1)]), None
        )
        if taken is None:
            return template, tuple(path)
        path.append(taken)
        position = taken


def settle(policy, betas, cost, rounds=400, seed=1):
    rng = random.Random(seed)
    for _ in range(rounds):
        template = policy.choose(1000)
        parents, path = judged(template, betas, rng) if template else ((), ())
        policy.observe(parents, path, round_s=cost(template))
    return policy.template(policy.current)


def truth(betas) -> AdaptiveTree:
    """A policy that knows the world's betas exactly."""
    known = AdaptiveTree(64, 4)
    known.tried = [1.0] * len(known.tried)
    known.taken = [betas[min(r, len(betas) - 1)] for r in range(len(known.taken))]
    return known


BETAS = [0.5, 0.4, 0.3, 0.25, 0.2]


def cost_of(per_node):
    def cost(template):  # a decode costs 1; a tree round 1.2 + per_node a node; drafting on top
        return 1.0 if not template else 1.2 + (per_node + 0.01) * len(template)

    return cost


@pytest.mark.parametrize(
    ("world", "per_node"),
    [("gpu: nodes nearly free", 0.0), ("cpu: a node costs a quarter of a decode", 0.25)],
)
def test_the_adaptive_policy_settles_on_the_best_true_rate(world, per_node):
    cost = cost_of(per_node)
    policy = AdaptiveTree(budget=64, depth=4, decode_len_max=1)
    got = settle(policy, BETAS, cost)
    known = truth(BETAS)
    rates = {s: known.expected_tokens(known.template(s)) / cost(known.template(s))
             for s in policy.sizes}  # fmt: skip
    best = max(rates.values())
    assert known.expected_tokens(got) / cost(got) >= 0.95 * best, (world, got, rates)
    assert policy.beta(0) == pytest.approx(0.5, abs=0.1)  # learned off the results
    if per_node == 0.0:
        assert len(got) >= 16  # cheap nodes: a wide tree
    else:
        assert len(got) <= 4  # dear nodes: the chain, or no draft at all


WEAK = [0.2, 0.12, 0.08, 0.06, 0.05, 0.04]
"""A weak draft's world (the real pair's conditioned draft takes its first guess ~1 in 4)."""
STRONG = [0.85, 0.3, 0.2, 0.1]


@pytest.mark.parametrize(("world", "betas"), [("weak draft", WEAK), ("strong draft", STRONG)])
def test_the_adaptive_policy_learns_the_shape_of_its_drafts_acceptance(world, betas):
    """At one node count (nodes free), the template it settles on holds within 3 % of the
    expected tokens of the best template for the world's true acceptance: wide at the root
    for a weak draft, deep along its first guesses for a strong one."""
    policy = AdaptiveTree(budget=32, depth=4, sizes=[32])
    got = settle(policy, betas, cost_of(0.0), rounds=600)
    known = truth(betas)
    best = known.template(32)
    assert known.expected_tokens(got) >= 0.97 * known.expected_tokens(best), (world, got, best)
    shape = nodes_per_depth(got)
    if betas is WEAK:
        assert shape[0] >= 12 and shape[0] > shape[1], shape
    else:
        assert len(shape) == 4 and shape[0] <= 8 and shape[3] >= 4, shape
    assert policy.to_dict()["shape"] == shape and policy.to_dict()["nodes"] == 32


def test_restore_counts_evidence_without_costs():
    policy = AdaptiveTree(budget=16, depth=4)
    for _ in range(30):
        policy.restore(PARENTS, (0, 3))
    assert policy.beta(0) > 0.8 and policy.cost_s == {}
    assert policy.choose(100) == ()  # no cost known yet: the sweep starts at its first size
    report = policy.to_dict()
    assert report["mode"] == "adaptive" and report["size"] == 16 and report["nodes"] == 16
    assert report["shape"] == nodes_per_depth(policy.template(16))


def test_a_rounds_cost_goes_to_the_size_it_was_drafted_at():
    """Drafting ahead chooses the next round before the last is observed: each observed
    round's seconds go to the size its template came from; a template cut short near the
    end, or one the drafts did not fill, to none."""
    policy = AdaptiveTree(budget=16, depth=4, sizes=[CHAIN, 16])
    first, second = policy.choose(100), policy.choose(100)  # both the untried chain
    assert first == second == full_parents([1, 1, 1, 1])
    policy.observe(first, (0,), round_s=0.5)
    policy.observe(second, (), round_s=0.7)
    assert policy.cost_s == {CHAIN: pytest.approx(0.8 * 0.5 + 0.2 * 0.7)}
    wide = policy.choose(100)
    assert len(wide) == 16
    policy.observe(wide[:5], (0,), round_s=9.0)  # not a template handed out: no cost
    policy.observe(cut(wide, 2), (), round_s=9.0)
    assert set(policy.cost_s) == {CHAIN}
    policy.observe(wide, (), round_s=1.0)
    assert policy.cost_s[16] == 1.0


# --- templates -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "depth", "shape"),
    [(4, 4, [1, 1, 1, 1]), (8, 4, [2, 1, 1, 1]), (16, 4, [4, 1, 1, 1]), (28, 4, [4, 2, 1, 1]),
     (64, 4, [4, 3, 2, 1]), (3, 4, [1, 1, 1]), (10, 2, [4, 1]), (0, 4, []), (8, 0, [])],
)  # fmt: skip
def test_a_node_budget_gives_its_shape(nodes, depth, shape):
    assert shape_for_budget(nodes, depth) == shape


@given(nodes=st.integers(1, 64), depth=st.integers(1, 8))
def test_a_shape_fits_its_budget_and_depth(nodes, depth):
    shape = shape_for_budget(nodes, depth)
    assert 1 <= shape_nodes(shape) <= nodes and len(shape) <= depth
    assert all(k >= 1 for k in shape)


def test_template_helpers():
    template = full_parents([3, 2])  # 3 at the root, 2 under each
    assert template == (-1, -1, -1, 0, 0, 1, 1, 2, 2)
    assert nodes_per_depth(template) == [3, 6] and most_children(template) == 3
    assert node_ranks(template) == [0, 1, 2, 0, 1, 0, 1, 0, 1]
    assert cut(template, 1) == (-1, -1, -1) and cut(template, 0) == ()
    assert cut(template, 5) == template
    assert path_values(template, [0.5, 0.2]) == pytest.approx(
        [0.5, 0.2, 0.0, 0.25, 0.1, 0.1, 0.04, 0.0, 0.0]
    )


def trees(nodes: int, depth: int):
    """Every tree of `nodes` nodes at most `depth` deep whose children are ranks 0..k-1 (the
    only trees drafting makes), each as its nodes' rank paths."""
    level = {frozenset()}
    for _ in range(nodes):
        grown = set()
        for tree in level:
            for path in [(), *tree]:
                child = (*path, 0)
                if len(child) <= depth and child not in tree:
                    grown.add(tree | {child})
                if path and (sibling := (*path[:-1], path[-1] + 1)) not in tree:
                    grown.add(tree | {sibling})
        level = grown
    return level


def value(paths, accept) -> float:
    total = 0.0
    for path in paths:
        v = 1.0
        for r in path:
            v *= accept[r] if r < len(accept) else 0.0
        total += v
    return total


FALLING = st.lists(st.floats(0.01, 1.0), min_size=6, max_size=6).map(
    lambda a: sorted(a, reverse=True)
)
"""Acceptance by rank, falling, for every rank six nodes can reach."""


@given(accept=FALLING, nodes=st.integers(1, 6), depth=st.integers(1, 3))
def test_best_first_holds_the_most_expected_tokens_of_any_tree(accept, nodes, depth):
    """Against every tree of that size and depth: no tree holds more (acceptance falling
    with rank, as a sorted draft row's does); and it is laid out breadth first, siblings by
    rank, as drafting lays a tree out."""
    template = best_first(accept, nodes, depth)
    best = max(value(t, accept) for t in trees(nodes, depth))
    assert sum(path_values(template, accept)) == pytest.approx(best, rel=1e-9)
    assert len(template) == nodes and len(nodes_per_depth(template)) <= depth
    depths = [len(nodes_per_depth(template[: i + 1])) for i in range(nodes)]
    assert depths == sorted(depths)  # breadth first
    assert all(p < i for i, p in enumerate(template))
    ranks = node_ranks(template)  # siblings in rank order: a later sibling, a later node
    assert all(ranks[i] < ranks[j] for i in range(nodes) for j in range(i + 1, nodes)
               if template[i] == template[j])  # fmt: skip
    assert best_first(accept, 0, depth) == () and best_first([], nodes, depth) == ()
    assert best_first(accept[:1], nodes, 1) == (-1,)  # no node past the known ranks


def test_best_first_goes_wide_for_a_weak_draft_and_deep_for_a_strong_one():
    weak = truth(WEAK).accept(64)
    assert nodes_per_depth(best_first(weak, 64, 4))[0] >= 24
    strong = truth(STRONG).accept(64)
    # the chain of first guesses (nodes 0, 2, 5, 7), then second guesses by what reaches
    # them: the root's (1), the first guess's (3), the second guess's first guess (4),
    # and, of two equal values, the first offered: the first guess's second's child (6)
    assert best_first(strong, 8, 4) == (-1, -1, 0, 0, 1, 2, 3, 5)
