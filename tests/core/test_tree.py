"""Tree rounds (muser.tree, docs/design.md §3): drafting without replacement, recursive
rejection sampling, the float64 reference held bit-equal, a chain judged exactly as the
linear round, greedy trees on the target's greedy path, the target's exact joint
distribution at T = 1, and every malformed tree refused before a draw."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muser.canonical import CanonicalError, Reader
from muser.errors import (
    DraftMismatchError,
    DraftZeroProbabilityError,
    RowCountError,
)
from muser.mt19937 import Mt19937
from muser.records import RoundRequest, RoundResult, Signed
from muser.sampling import SparseRow
from muser.tree import (
    Tree,
    TreeTopologyError,
    check_path,
    draft_tree,
    judge_tree,
    judge_tree_reference,
    per_path,
    replay_tree,
    tree_draws,
)
from muser.tree_width import full_parents
from muser.verify import judge_round
from tests.lanes.test_joint_distribution import Z_BOUND, wilson_hilferty

VOCAB = 4
MAX_NODES = 64


def markov(seed: int, vocab: int = VOCAB, support: int | None = None):
    """Order-1 rows: row[prev] over the vocabulary (the draft's cut to `support` ids)."""
    gen = np.random.default_rng(seed)
    rows = gen.dirichlet(np.full(vocab, 0.7), size=vocab)
    if support is None:
        return rows
    out = []
    for row in rows:
        ids = np.sort(np.argsort(-row, kind="stable")[:support]).astype(np.int64)
        out.append(SparseRow(ids, row[ids].astype(np.float64)))
    return out


TARGET = markov(11)
DRAFT = markov(5, support=3)


def last_token(frontier: int, path: list[int]) -> int:
    return path[-1] if path else frontier


def round_of(rng: Mt19937, frontier: int, shape, greedy: bool, target=TARGET, draft=DRAFT):
    """Draft a tree after `frontier` and the target's witness rows at its positions; `shape`
    is children per depth (a list) or a template (a tuple of parents)."""
    template = full_parents(shape) if isinstance(shape, list) else shape
    tree = draft_tree(
        rng, template, per_path(lambda path: draft[last_token(frontier, path)]), greedy
    )
    ends = [frontier] + [tree.tokens[i] for i in range(tree.size)]
    witness = np.stack([target[t] for t in ends])
    return tree, witness


def judged(seed: int, frontier: int, branching, greedy: bool, judge=judge_tree):
    state = Mt19937.from_seed(seed)
    drafting = state.copy()
    tree, witness = round_of(drafting, frontier, branching, greedy)
    return tree, judge(state, frontier, tree, witness, greedy=greedy, max_nodes=MAX_NODES)


# --- the chain is the linear round ---------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), depth=st.integers(1, 6), greedy=st.booleans())
def test_a_chain_is_judged_exactly_as_the_linear_round(seed, depth, greedy):
    state = Mt19937.from_seed(seed)
    tree, witness = round_of(state.copy(), 1, [1] * depth, greedy)
    chain = Tree.chain(tree.tokens, tree.q_rows[:-1])
    assert chain == tree  # one child a position, breadth first: the chain's own layout
    got = judge_tree(state, 1, tree, witness, greedy=greedy, max_nodes=MAX_NODES)
    want = judge_round(state, 1, list(tree.tokens), list(tree.q_rows[:-1]), witness, greedy=greedy)
    assert (got.accepted, got.next_frontier, got.draws) == (
        want.accepted,
        want.next_frontier,
        want.draws,
    )
    assert got.post_state.to_bytes() == want.post_state.to_bytes()


# --- fast and reference ----------------------------------------------------------------------


TEMPLATES = st.lists(st.integers(0, 99), min_size=1, max_size=8).map(
    lambda xs: tuple(x % (i + 1) - 1 for i, x in enumerate(xs))
)
"""Any template (node i's parent: the root or an earlier node), not only uniform ones."""


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    branching=st.lists(st.integers(1, 3), min_size=1, max_size=3) | TEMPLATES,
    frontier=st.integers(0, VOCAB - 1),
    greedy=st.booleans(),
)
def test_the_fast_judge_equals_the_float64_reference(seed, branching, frontier, greedy):
    fast_tree, fast = judged(seed, frontier, branching, greedy)
    _, ref = judged(seed, frontier, branching, greedy, judge_tree_reference)
    assert (fast.path, fast.next_frontier, fast.draws) == (ref.path, ref.next_frontier, ref.draws)
    assert fast.post_state.to_bytes() == ref.post_state.to_bytes()
    assert fast.draws >= 1 or greedy
    # what a result's reader recomputes from its topology and path (muser.records)
    assert tree_draws(fast_tree.parents, fast.path, greedy) == fast.draws


def test_a_tree_is_drafted_into_its_template():
    """Each position gets its template node's children, drawn in rank order; a row whose
    support is smaller gives fewer, and a child it could not give has no subtree."""
    template = (-1, -1, 0, 0, 0, 1)  # the root: 2 children; its first: 3; its second: 1
    for greedy in (True, False):
        tree, _ = round_of(Mt19937.from_seed(3), 1, template, greedy)
        assert tree.parents == template
        wide = (-1, -1, -1, -1, 3, 3, 0)  # the root's fourth child has two; the rows hold 3
        tree, _ = round_of(Mt19937.from_seed(3), 1, wide, greedy)
        assert tree.parents == (-1, -1, -1, 0)


def test_draws_follow_the_written_order():
    """Drafting: at each position in order, one draw per child; judging: one per child tried
    and one for the next frontier."""
    state = Mt19937.from_seed(3)
    tree, witness = round_of(state.copy(), 0, [2, 2], greedy=False)
    assert tree.size == 6 and [len(tree.children(v)) for v in range(7)] == [2, 2, 2, 0, 0, 0, 0]
    after_drafting = replay_tree(state, tree, greedy=False)
    assert after_drafting.draws - state.draws == 6
    decision = judge_tree(state, 0, tree, witness, greedy=False, max_nodes=MAX_NODES)
    tried = decision.draws - 6
    # each accepted step tried some children; the last position tried all or drew a bonus
    assert 1 <= tried <= 2 * 2 + 1


# --- greedy ------------------------------------------------------------------------------------


def greedy_decode(frontier: int, n: int, target=TARGET) -> list[int]:
    out, last = [], frontier
    for _ in range(n):
        last = int(np.argmax(target[last]))
        out.append(last)
    return out


@pytest.mark.parametrize("branching", [[1], [2], [3, 2], [2, 2, 2], [4, 1, 1, 1]])
@pytest.mark.parametrize("frontier", range(VOCAB))
def test_a_greedy_tree_emits_the_targets_greedy_path(branching, frontier):
    tree, decision = judged(0, frontier, branching, greedy=True)
    emitted = decision.emitted(tree)
    assert emitted == greedy_decode(frontier, len(emitted))
    assert decision.draws == 0


def test_a_wider_greedy_tree_accepts_where_a_chain_does_not():
    """Frontier 2: the draft's first choice misses the target's; its second does not."""
    wins = 0
    for frontier in range(VOCAB):
        chain = judged(0, frontier, [1, 1], greedy=True)[1].accepted
        wide = judged(0, frontier, [3, 1], greedy=True)[1].accepted
        assert wide >= chain
        wins += wide > chain
    assert wins >= 1


# --- the target's exact joint distribution at T = 1 --------------------------------------------

LENGTH = 3


def exact_joint(frontier: int) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        p, prev = 1.0, frontier
        for token in seq:
            p, prev = p * TARGET[prev][token], token
        joint[seq] = p
    return joint


#        root          a template no uniform shape spells (a best-first one's kind:
#      /  |  \         wide at the root, the first guess followed deeper)
#     0   1   2
#    / \   |
#   3   4  5
BEST_FIRST_LIKE = (-1, -1, -1, 0, 0, 1)


@pytest.mark.parametrize("branching", [[2, 2], [3, 1, 1], [1, 3], BEST_FIRST_LIKE])
def test_the_first_three_tokens_are_distributed_as_the_target_alone(branching):
    frontier, runs = 1, 12_000
    exact = exact_joint(frontier)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for run in range(runs):
        state, emitted, last = Mt19937.from_seed(run * 2654435761 % 2**32), [], frontier
        while len(emitted) < LENGTH:  # rounds chained on the stream, as a session's are
            tree, witness = round_of(state.copy(), last, branching, greedy=False)
            decision = judge_tree(state, last, tree, witness, greedy=False, max_nodes=MAX_NODES)
            state = decision.post_state
            out = decision.emitted(tree)
            accepted += decision.accepted
            emitted += out
            last = out[-1]
        key = tuple(emitted[:LENGTH])
        counts[key] = counts.get(key, 0) + 1
    chi2 = sum((counts.get(k, 0) - runs * p) ** 2 / (runs * p) for k, p in exact.items())
    z = wilson_hilferty(chi2, len(exact) - 1)
    assert z < Z_BOUND, (
        f"first {LENGTH} tokens over {runs} runs: chi2 {chi2:.1f} on {len(exact) - 1} dof, "
        f"z = {z:.2f} >= {Z_BOUND} (false-failure probability of this assertion ~2.9e-7)"
    )
    assert accepted > runs  # the trees were used: more than one token a run was accepted


def test_the_same_seed_gives_the_same_tokens():
    a = judged(99, 2, [3, 2], greedy=False)
    b = judged(99, 2, [3, 2], greedy=False)
    assert a[0] == b[0] and a[1].emitted(a[0]) == b[1].emitted(b[0])


# --- malformed trees, refused before a draw ----------------------------------------------------


def base():
    state = Mt19937.from_seed(4)
    tree, witness = round_of(state.copy(), 0, [2, 1], greedy=False)
    return state, tree, witness


def refused(tree, witness, error, match, max_nodes=MAX_NODES, state=None):
    state = state or Mt19937.from_seed(4)
    before = state.to_bytes()
    with pytest.raises(error, match=match):
        judge_tree(state, 0, tree, witness, greedy=False, max_nodes=max_nodes)
    assert state.to_bytes() == before


def test_a_parent_that_is_no_node_is_refused_as_an_orphan():
    _, tree, witness = base()
    bad = Tree((-1, -1, 7, 1), tree.tokens, tree.q_rows)
    refused(bad, witness, TreeTopologyError, "parent 7 is no node")


def test_a_parent_after_its_child_is_refused_so_no_cycle_can_be_written():
    _, tree, witness = base()
    cyclic = Tree((-1, 3, 0, 1), tree.tokens, tree.q_rows)  # node 1 <- node 3 <- node 1
    refused(cyclic, witness, TreeTopologyError, "not an earlier node")
    selfish = Tree((-1, 1, 0, 1), tree.tokens, tree.q_rows)
    refused(selfish, witness, TreeTopologyError, "node 1: parent 1 is not an earlier node")


def test_duplicate_siblings_are_refused():
    _, tree, witness = base()
    twins = Tree(tree.parents, (tree.tokens[0], tree.tokens[0], *tree.tokens[2:]), tree.q_rows)
    refused(twins, witness, TreeTopologyError, "twice among the children of position 0")


def test_too_many_nodes_are_refused_naming_the_budget():
    _, tree, witness = base()
    refused(tree, witness, TreeTopologyError, "1 to 3 nodes .* got 4", max_nodes=3)
    empty = Tree((), (), (None,))
    refused(empty, witness[:1], TreeTopologyError, "got 0")


def test_rows_that_do_not_fit_the_topology_are_refused():
    _, tree, witness = base()
    refused(tree, witness[:-1], RowCountError, "need 5 witness rows")
    short = Tree(tree.parents, tree.tokens, tree.q_rows[:-1])
    refused(short, witness, RowCountError, "need 5 draft rows")
    row = tree.q_rows[0]
    stray = Tree(tree.parents, tree.tokens, (*tree.q_rows[:-1], row))
    refused(stray, witness, TreeTopologyError, "position 4 has a draft row and no children")
    missing = Tree(tree.parents, tree.tokens, (None, *tree.q_rows[1:]))
    refused(missing, witness, RowCountError, "position 0 has children and no draft row")


def test_a_child_the_row_gives_no_probability_is_refused():
    _, tree, witness = base()
    row = tree.q_rows[0]
    absent = next(t for t in range(VOCAB) if row.probability(t) == 0.0)
    bad = Tree(tree.parents, (absent, *tree.tokens[1:]), tree.q_rows)
    refused(bad, witness, DraftZeroProbabilityError, f"token {absent} has draft probability")


def test_a_tree_the_draws_did_not_select_is_refused():
    state, tree, witness = base()
    swapped = Tree(tree.parents, (tree.tokens[1], tree.tokens[0], *tree.tokens[2:]), tree.q_rows)
    refused(swapped, witness, DraftMismatchError, "node 0: the replayed draw", state=state)
    with pytest.raises(DraftMismatchError):
        judge_tree_reference(state, 0, swapped, witness, greedy=False, max_nodes=MAX_NODES)


def test_an_accepted_path_must_descend_from_the_root():
    parents = (-1, -1, 0, 1, 2)
    check_path(parents, ())
    check_path(parents, (1, 3))
    for bad, why in [((2,), "node 2 is not a child of the root"), ((0, 3), "not a child of node 0"),
                     ((0, 2, 9), "node 9 is not")]:  # fmt: skip
        with pytest.raises(TreeTopologyError, match=why):
            check_path(parents, bad)


def test_tree_records_are_their_own_domain():
    """A tree request and result encode under their own domains: a reader of chains
    refuses them rather than read the nodes as a chain; a chain's bytes are unchanged."""
    request = RoundRequest(b"s" * 16, 0, 1, b"h" * 32, 3, (4, 5), (SparseRow([4, 5], [1.0, 1.0]),),
                           b"m" * 32, (), "k", 1, (-1, -1))  # fmt: skip
    back = RoundRequest.decode(request.encode())
    assert back.parents == (-1, -1) and back.encode() == request.encode()
    with pytest.raises(CanonicalError):
        Reader(request.encode(), "round-request")
    chain = dataclasses.replace(request, parents=(), drafts=(4,))
    assert RoundRequest.decode(chain.encode()).parents == ()
    result = RoundResult(b"s" * 16, 0, 1, b"p" * 32, b"d" * 32, 3, (4, 5), 1, 9, b"m" * 32,
                         b"t" * 32, (), b"h" * 32, "v", (), (-1, -1), (1,))  # fmt: skip
    assert RoundResult.decode(result.encode()) == result
    assert result.emitted() == [5, 9]
    with pytest.raises(CanonicalError):
        Reader(result.encode(), "round-result")
    lying = dataclasses.replace(result, accepted=2)
    with pytest.raises(CanonicalError, match="accepts 2 nodes along a path of 1"):
        RoundResult.decode(lying.encode())
    signed = Signed(result.encode(), b"")
    assert RoundResult.decode(signed.body).path == (1,)
