"""A token tree in one target forward (`TorchBackend.evaluate_tree`, docs/design.md §3): every
node's row is the row a linear forward of its path gives (within the batched path's 1e-4 in
log-probability), on the lean forward and on transformers' own; `keep_path` keeps the
accepted path's KV so the sequence goes on as if it had evaluated that path alone; and a
tree the block cannot hold is refused."""

from __future__ import annotations

import numpy as np
import pytest

from muser_app.testing import ARCHES
from tests.backends.backend_helpers import PROMPT, build_backend

#      root
#     /  |  \
#    0   1   2
#   / \      |
#  3   4     5
#  |
#  6
PARENTS = [-1, -1, -1, 0, 0, 2, 3]
TOKENS = [PROMPT[9], 300, 77, 2, 150, 33, 260, 41]  # root (the frontier), then nodes 0..6


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def path_of(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


def linear_row(backend, base, tokens: list[int]) -> np.ndarray:
    seq = base.clone()
    return seq.evaluate(tokens)[-1]


@pytest.fixture(params=["lean", "transformers"])
def forward(request):
    return request.param


def _backend(checkpoint, arch, forward):
    backend = build_backend("torch", checkpoint(arch))
    assert backend._lean is not None  # the tiny checkpoints take the lean forward
    if forward == "transformers":
        backend._lean = None
    return backend


@pytest.mark.parametrize("arch", ARCHES)
def test_every_node_gets_the_row_of_its_path_evaluated_alone(checkpoint, arch, forward):
    backend = _backend(checkpoint, arch, forward)
    base = backend.sequence()
    base.evaluate(PROMPT[:9])
    seq = base.clone()
    rows = backend.evaluate_tree(seq, TOKENS, PARENTS)
    assert rows.shape == (len(TOKENS), backend.vocab_size)
    want = [linear_row(backend, base, [TOKENS[0]])]
    want += [linear_row(backend, base, [TOKENS[0], *(TOKENS[1 + i] for i in path_of(n))])
             for n in range(len(PARENTS))]  # fmt: skip
    worst = float(np.abs(log_softmax(rows) - log_softmax(np.stack(want))).max())
    assert worst < 1e-4, worst
    assert seq.length == 9  # the block is held, not committed


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("path", [[], [0], [0, 3, 6], [2, 5], [1]])
def test_the_kept_path_goes_on_as_if_evaluated_alone(checkpoint, arch, path, forward):
    backend = _backend(checkpoint, arch, forward)
    base = backend.sequence()
    base.evaluate(PROMPT[:9])
    seq, alone = base.clone(), base.clone()
    backend.evaluate_tree(seq, TOKENS, PARENTS)
    seq.keep_path(path)
    kept = [TOKENS[0], *(TOKENS[1 + i] for i in path)]
    assert seq.length == 9 + len(kept) and seq._tokens[9:] == kept
    alone.evaluate(kept)
    nxt = [PROMPT[12], PROMPT[13], PROMPT[14]]
    got, want = seq.evaluate(nxt), alone.evaluate(nxt)
    worst = float(np.abs(log_softmax(got) - log_softmax(want)).max())
    assert worst < 1e-4, worst


def test_a_tree_or_a_path_the_block_cannot_hold_is_refused(checkpoint):
    backend = build_backend("torch", checkpoint("llama"))
    seq = backend.sequence()
    seq.evaluate(PROMPT[:4])
    with pytest.raises(ValueError, match="node 1: parent 1 is not -1"):
        backend.evaluate_tree(seq, TOKENS[:3], [-1, 1])
    with pytest.raises(ValueError, match="has 2 parents, got 1"):
        backend.evaluate_tree(seq, TOKENS[:3], [-1])
    with pytest.raises(ValueError, match="no tree block is held"):
        seq.keep_path([0])
    backend.evaluate_tree(seq, TOKENS, PARENTS)
    with pytest.raises(ValueError, match="outside the block"):
        seq.keep_path([7])
    seq.evaluate([PROMPT[5]])  # a forward over the block: it is gone
    with pytest.raises(ValueError, match="no tree block is held"):
        seq.keep_path([0])
    assert seq.length == 5


@pytest.mark.parametrize("arch", ARCHES)
def test_a_mixed_batch_gives_each_chain_and_tree_its_own_rows(checkpoint, arch, forward):
    """`evaluate_mixed`: trees and chains of several sequences of different lengths in one
    forward (the verifier's batch of tree and chain rounds): each gets the rows it gets
    alone, a chain is committed and a tree's block held for `keep_path`."""
    backend = _backend(checkpoint, arch, forward)
    base = backend.sequence()
    base.evaluate(PROMPT[:9])
    short = backend.sequence()
    short.evaluate(PROMPT[:4])
    tree_seq, chain_seq, other_tree = base.clone(), short.clone(), short.clone()
    small = ([PROMPT[4], 9, 10], [-1, 0])
    got = backend.evaluate_mixed(
        [(tree_seq, TOKENS, PARENTS), (chain_seq, PROMPT[4:8], None), (other_tree, *small)]
    )
    want = [
        backend.evaluate_tree(base.clone(), TOKENS, PARENTS),
        short.clone().evaluate(PROMPT[4:8]),
        backend.evaluate_tree(short.clone(), *small),
    ]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        worst = float(np.abs(log_softmax(g) - log_softmax(w)).max())
        assert worst < 1e-4, worst
    assert (tree_seq.length, chain_seq.length, other_tree.length) == (9, 8, 4)
    tree_seq.keep_path([0, 3])
    other_tree.keep_path([0])
    assert tree_seq._tokens[9:] == [TOKENS[0], TOKENS[1], TOKENS[4]]
    with pytest.raises(ValueError, match="at least one token"):
        backend.evaluate_mixed([(tree_seq, [], None)])


@pytest.mark.parametrize("arch", ARCHES)
def test_a_tree_captures_each_entrys_rows_of_its_path(checkpoint, arch, forward):
    """`evaluate_tree_capture` / `evaluate_mixed_capture` (a capturing session's tree round):
    every entry's capture rows are the rows a linear forward of its path captures at its
    last position (within float rounding), the logits are `evaluate_tree`'s, and a chain
    beside it in the batch keeps its own layers' rows."""
    backend = _backend(checkpoint, arch, forward)
    base = backend.sequence()
    base.evaluate(PROMPT[:9])
    layers = [1, 0]
    rows, captured = backend.evaluate_tree_capture(base.clone(), TOKENS, PARENTS, layers)
    plain = backend.evaluate_tree(base.clone(), TOKENS, PARENTS)
    assert float(np.abs(rows - plain).max()) < 1e-5
    assert sorted(captured) == [0, 1]
    for n in range(-1, len(PARENTS)):
        path = [TOKENS[0], *(TOKENS[1 + i] for i in path_of(n))] if n >= 0 else [TOKENS[0]]
        _, want = base.clone().evaluate_capture(path, layers)
        for layer in layers:
            assert captured[layer].shape == (len(TOKENS), backend.geometry.hidden_size)
            np.testing.assert_allclose(captured[layer][n + 1], want[layer][-1], atol=1e-4)
    chain = base.clone()
    (_, tree_rows), (_, chain_rows) = backend.evaluate_mixed_capture(
        [(base.clone(), TOKENS, PARENTS, [0]), (chain, PROMPT[9:12], None, [1])]
    )
    assert sorted(tree_rows) == [0] and sorted(chain_rows) == [1]
    np.testing.assert_allclose(tree_rows[0], captured[0], atol=1e-4)
    _, want = base.clone().evaluate_capture(PROMPT[9:12], [1])
    np.testing.assert_allclose(chain_rows[1], want[1], atol=1e-4)
    assert chain.length == 12
