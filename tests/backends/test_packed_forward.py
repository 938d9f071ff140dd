"""The packed forward (muser_torch/llama_forward.py `PackedLlama`): the lean forward over
projection weights reordered once for oneDNN, attending one query at a time. Its rows are
the transformers rows within rounding (not bit for bit) on both torch paths, and a position's
row does not depend on the path that computed it (one-token decode, a chunk, a prefill, a
ragged batch, a tree) down to the last bit. "auto" takes it for models whose largest matrix
reaches PACK_MIN_ELEMENTS (the real pair's target: tests/realpair), the lean forward below;
a named "packed" that cannot hold is refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import InvalidOverrideError
from muser_app.testing import ARCHES
from muser_torch import llama_forward
from tests.backends.backend_helpers import PROMPT, build_backend


def _logprobs(rows: np.ndarray) -> np.ndarray:
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    assert np.abs(_logprobs(a) - _logprobs(b)).max() <= 1e-5


def _projections(model) -> list:
    """Every weight the forward multiplies by: 7 a layer, then the head."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        out += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return [m.weight for m in out] + [model.lm_head.weight]


@pytest.fixture
def pack_all(monkeypatch) -> None:
    """ "auto" packs even the tiny checkpoints."""
    monkeypatch.setattr(llama_forward, "PACK_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("arch", ARCHES)
def test_packed_rows_are_the_transformers_rows_within_rounding(checkpoint, arch) -> None:
    """One KV (a prefill, single tokens, a chunk after a rollback) and a ragged batch (one
    sequence sitting out, then alone): log-probabilities within 1e-5 of the module tree's.
    qwen2's biased q/k/v go through the packed product with their bias."""
    path = checkpoint(arch)
    packed = build_backend("torch", path, forward="packed")
    plain = build_backend("torch", path, forward="transformers")
    assert packed.forward_kind == "packed"
    layer = packed._lean.layers[0]
    weights = [layer.q[0], layer.k[0], layer.v[0], layer.o[0], layer.gate, layer.up, layer.down]
    assert all(isinstance(w, llama_forward._Packed) for w in [*weights, packed._lean.lm_head])
    for chunk in (PROMPT[:7], PROMPT[7:8], PROMPT[8:11], PROMPT[11:]):
        _close(packed.evaluate(chunk), plain.evaluate(chunk))
    packed.rollback(6)
    plain.rollback(6)
    _close(packed.evaluate(PROMPT[3:9]), plain.evaluate(PROMPT[3:9]))
    ours = [packed.sequence() for _ in range(3)]
    theirs = [plain.sequence() for _ in range(3)]
    steps = [
        [PROMPT[:5], PROMPT[:2], PROMPT[:9]],
        [PROMPT[5:6], PROMPT[2:3], PROMPT[9:10]],
        [PROMPT[6:10], PROMPT[3:4]],
        [PROMPT[10:11]],
    ]
    for step in steps:
        a = packed.evaluate_batch(list(zip(ours, step, strict=False)))
        b = plain.evaluate_batch(list(zip(theirs, step, strict=False)))
        for x, y in zip(a, b, strict=True):
            _close(x, y)


@pytest.mark.parametrize("arch", ARCHES)
def test_a_positions_row_is_the_same_bits_on_every_path(checkpoint, arch) -> None:
    """The rows of PROMPT (16 positions), computed five ways on the packed forward, are one
    set of bits: one token at a time; as a prefill of 9 and chunks of 3, 1 and 3; as one
    prefill; in a ragged batch beside two other sequences of other lengths; and as the path
    of a token tree whose other branches are different tokens. (The lean forward's rows
    differ between these paths in the last bits: attention over a batch of queries sums in
    another order than a lone query's.)"""
    backend = build_backend("torch", checkpoint(arch), forward="packed")
    one = backend.sequence()
    lone = np.concatenate([one.evaluate([t]) for t in PROMPT])
    chunked = backend.sequence()
    parts = [chunked.evaluate(PROMPT[i:j]) for i, j in ((0, 9), (9, 12), (12, 13), (13, 16))]
    whole = backend.sequence().evaluate(PROMPT)
    seqs = [backend.sequence() for _ in range(3)]
    got = []
    for step in ([PROMPT[:6], PROMPT[3:14], PROMPT[:2]], [PROMPT[6:10], [5], PROMPT[7:13]],
                 [PROMPT[10:16], PROMPT[:3], [9]]):  # fmt: skip
        got.append(backend.evaluate_batch(list(zip(seqs, step, strict=True)))[0])
    tree = backend.sequence()
    tree.evaluate(PROMPT[:12])
    # root PROMPT[12]; node 0 = PROMPT[13] and node 1 a sibling; node 2 = PROMPT[14] under
    # node 0, node 3 a sibling of it; node 4 = PROMPT[15] under node 2
    rows = backend.evaluate_tree(
        tree, [PROMPT[12], PROMPT[13], 7, PROMPT[14], 8, PROMPT[15]], [-1, -1, 0, 0, 2]
    )
    path = rows[[0, 1, 3, 5]]
    for other in (np.concatenate(parts), whole, np.concatenate(got)):
        assert other.shape == lone.shape and np.array_equal(other, lone)
    assert np.array_equal(path, lone[12:])


def test_one_kv_capture_comes_from_the_packed_forward(checkpoint) -> None:
    """Captured rows are the kept outputs of the forward that computed the logits: the same
    call without capture gives the very same logits, and the layers are the transformers
    layers' outputs within rounding."""
    path = checkpoint("llama")
    packed = build_backend("torch", path, forward="packed")
    twin = build_backend("torch", path, forward="packed")
    plain = build_backend("torch", path, forward="transformers")
    rows, hidden = packed.evaluate_capture(PROMPT[:6], [0, 1])
    assert np.array_equal(rows, twin.evaluate(PROMPT[:6]))
    ref_rows, ref = plain.evaluate_capture(PROMPT[:6], [0, 1])
    _close(rows, ref_rows)
    for layer in (0, 1):
        assert hidden[layer].shape == ref[layer].shape
        np.testing.assert_allclose(hidden[layer], ref[layer], rtol=0, atol=1e-5)


def test_auto_packs_from_the_threshold_up(checkpoint, monkeypatch) -> None:
    """PACK_MIN_ELEMENTS takes effect: "auto" packs a model whose largest matrix has that
    many elements, and runs the lean forward one element short of it."""
    path = checkpoint("llama")
    model = build_backend("torch", path)._model
    largest = max(p.numel() for p in model.parameters() if p.dim() == 2)
    monkeypatch.setattr(llama_forward, "PACK_MIN_ELEMENTS", largest)
    assert build_backend("torch", path).forward_kind == "packed"
    monkeypatch.setattr(llama_forward, "PACK_MIN_ELEMENTS", largest + 1)
    assert build_backend("torch", path).forward_kind == "lean"
    assert build_backend("torch", path, forward="packed").forward_kind == "packed"  # by name


def test_the_default_threshold_leaves_the_tiny_checkpoints_lean(checkpoint) -> None:
    """Below PACK_MIN_ELEMENTS oneDNN's call costs more than it saves: "auto" runs the tiny
    checkpoints on the lean forward, bit-equal to transformers."""
    path = checkpoint("llama")
    auto = build_backend("torch", path)
    plain = build_backend("torch", path, forward="transformers")
    assert auto.forward_kind == "lean"
    assert np.array_equal(auto.evaluate(PROMPT[:8]), plain.evaluate(PROMPT[:8]))


@pytest.mark.parametrize(
    ("opts", "why"),
    [
        ({"dtype": "bfloat16"}, "dtype bfloat16 (packing is for float32)"),
        ({"dtype": "float16"}, "dtype float16 (packing is for float32)"),
    ],
)
def test_packing_is_refused_where_it_cannot_run(checkpoint, pack_all, opts, why) -> None:
    path = checkpoint("llama")
    assert build_backend("torch", path, **opts).forward_kind == "lean"  # auto: the next one
    with pytest.raises(InvalidOverrideError, match=rf"forward 'packed' refused .*\(packed: "
                       rf"{why.replace('(', '.').replace(')', '.')}\)"):  # fmt: skip
        build_backend("torch", path, forward="packed", **opts)


def test_a_torch_without_onednn_packing_is_refused(checkpoint, pack_all, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    path = checkpoint("llama")
    assert build_backend("torch", path).forward_kind == "lean"
    with pytest.raises(InvalidOverrideError, match=r"has no oneDNN prepacked linear"):
        build_backend("torch", path, forward="packed")


def test_a_packed_forward_that_disagrees_is_not_used(checkpoint, pack_all, monkeypatch) -> None:
    """A packed product off by 1e-2 (a lost bias, a wrong layout) misses PACKED_TOLERANCE:
    "auto" falls back to the lean forward, "packed" by name is refused."""
    real = llama_forward.PackedLlama._linear

    def off(self, x, weight, bias=None):
        return real(self, x, weight, bias) + 1e-2

    monkeypatch.setattr(llama_forward.PackedLlama, "_linear", off)
    path = checkpoint("llama")
    assert build_backend("torch", path).forward_kind == "lean"
    with pytest.raises(InvalidOverrideError, match=r"packed: its one-KV rows differ"):
        build_backend("torch", path, forward="packed")


def test_a_packed_forward_whose_rows_follow_the_path_is_not_used(checkpoint, pack_all,
                                                                 monkeypatch) -> None:  # fmt: skip
    """Within tolerance of transformers is not enough: a product whose rows move with the
    number of rows beside them (here by 1e-6 a row) breaks the invariance the load check
    also holds, so "auto" falls back to the lean forward and "packed" is refused."""
    real = llama_forward.PackedLlama._linear

    def drifting(self, x, weight, bias=None):
        out = real(self, x, weight, bias)
        return out + 1e-6 * x.reshape(-1, x.shape[-1]).shape[0]

    monkeypatch.setattr(llama_forward.PackedLlama, "_linear", drifting)
    path = checkpoint("llama")
    assert build_backend("torch", path).forward_kind == "lean"
    with pytest.raises(InvalidOverrideError, match=r"packed: its batched rows are not its one-K"):
        build_backend("torch", path, forward="packed")


def test_a_fork_shares_the_packed_weights(checkpoint) -> None:
    """A draft session's fork runs the very packed forward (no second copy of the weights)
    and gives bit-equal rows for the same tokens."""
    backend = build_backend("torch", checkpoint("llama"), forward="packed")
    twin = backend.fork()
    assert twin._lean is backend._lean
    assert np.array_equal(twin.evaluate(PROMPT[:9]), backend.evaluate(PROMPT[:9]))
