"""The tree round's shape policy (muser.tree_width): rank outcomes read off a result's
topology and path, the expected-tokens model (a chain's is the chain width's own), and an
adaptive policy that settles on the shape with the best true rate when nodes are cheap
(a GPU's flat forward) and when they are dear (this CPU's)."""

from __future__ import annotations

import random

import pytest

from muser.tree import full_parents, shape_nodes
from muser.tree_width import (
    AdaptiveTree,
    FixedTree,
    candidate_shapes,
    rank_outcomes,
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
    assert policy.expected_tokens([1, 1, 1, 1]) == pytest.approx(expected_tokens(0.3, 4))
    assert policy.expected_tokens([]) == 1.0  # the local lane's plain step
    assert AdaptiveTree(16, 4, decode_len_max=8).expected_tokens([]) == 8.0
    # a second child at the root raises what the first position passes
    policy.taken[1], policy.tried[1] = 2.0, 10.0
    one, two = policy.expected_tokens([1, 1]), policy.expected_tokens([2, 1])
    assert two == pytest.approx(1 + (1 - 0.7 * 0.8) * (1 + 0.3)) and two > one


def test_candidates_and_the_fixed_shape():
    assert candidate_shapes(16, 4) == [[], [1, 1, 1, 1], [2, 1, 1, 1], [4, 1, 1, 1]]
    assert candidate_shapes(64, 4)[-1] == [4, 3, 2, 1]
    fixed = tree_policy("fixed", 16, 4)
    assert isinstance(fixed, FixedTree) and fixed.choose(100) == [4, 1, 1, 1]
    assert fixed.choose(3) == [4, 1]  # never deeper than what is left
    assert isinstance(tree_policy("adaptive", 16, 4), AdaptiveTree)
    with pytest.raises(ValueError, match="expected 1 <= depth <= budget"):
        AdaptiveTree(budget=2, depth=4)


def judged(shape, betas, rng):
    """A round of `shape` judged in a world where rank r accepts with betas[r]."""
    parents, path, position = full_parents(shape), [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == position]
        taken = next((i for r, i in enumerate(kids) if rng.random() < betas[r]), None)
        if taken is None:
            return parents, tuple(path)
        path.append(taken)
        position = taken


def settle(policy, betas, cost, rounds=400, seed=1):
    rng = random.Random(seed)
    for _ in range(rounds):
        shape = policy.choose(1000)
        parents, path = judged(shape, betas, rng) if shape else ((), ())
        policy.observe(parents, path, round_s=cost(shape))
    return list(policy.current)


def true_rate(shape, betas, cost, decode_len):
    reference = AdaptiveTree(64, 4, decode_len)
    reference.tried = [1.0] * 8
    reference.taken = [betas[min(r, len(betas) - 1)] for r in range(8)]
    return reference.expected_tokens(shape) / cost(shape)


BETAS = [0.5, 0.4, 0.3, 0.25, 0.2]


@pytest.mark.parametrize(
    ("world", "per_node"),
    [("gpu: nodes nearly free", 0.0), ("cpu: a node costs a quarter of a decode", 0.25)],
)
def test_the_adaptive_policy_settles_on_the_best_true_rate(world, per_node):
    def cost(shape):  # a decode costs 1; a tree round 1.2 + per_node a node; drafting on top
        return 1.0 if not shape else 1.2 + (per_node + 0.01) * shape_nodes(shape)

    policy = AdaptiveTree(budget=64, depth=4, decode_len_max=1)
    got = settle(policy, BETAS, cost)
    rates = {tuple(s): true_rate(s, BETAS, cost, 1) for s in policy.shapes}
    best = max(rates, key=rates.get)
    assert rates[tuple(got)] >= 0.95 * rates[best], (world, got, best, rates)
    assert policy.beta(0) == pytest.approx(0.5, abs=0.1)  # learned off the results
    if per_node == 0.0:
        assert shape_nodes(got) >= 16  # cheap nodes: a wide tree
    else:
        assert shape_nodes(got) <= 4  # dear nodes: the chain, or no draft at all


def test_restore_counts_evidence_without_costs():
    policy = AdaptiveTree(budget=16, depth=4)
    for _ in range(30):
        policy.restore(PARENTS, (0, 3))
    assert policy.beta(0) > 0.8 and policy.cost_s == {}
    assert policy.choose(100) == []  # no cost known yet: the sweep starts at its first shape
    report = policy.to_dict()
    assert report["mode"] == "adaptive" and report["shape"] == [4, 1, 1, 1]
