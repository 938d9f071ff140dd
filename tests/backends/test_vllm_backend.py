"""The vLLM target backend (marker `vllm`: runs in .venv-vllm, `make test-vllm`).

The backend contract, the same rows as the torch backend on the same checkpoint, KV reuse
across rounds, rollback across cached blocks and every override taking effect. Greedy output
on the natural fixtures: tests/lanes/test_vllm_lanes.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import CaptureLayerError, ContextOverflowError, InvalidOverrideError
from muser_app.testing import ARCHES
from tests.backends.backend_helpers import (
    PROMPT,
    build_backend,
    checkpoint_options,
    float64_rows,
)
from tests.backends.contract import BackendContract, softmax64

pytestmark = pytest.mark.vllm

LONG = [int(t) for t in np.random.default_rng(5).integers(0, 320, 200)]


class TestVllmContract(BackendContract):
    @pytest.fixture
    def kind(self) -> str:
        return "vllm"


@pytest.fixture(scope="module")
def vllm_path(checkpoint):
    return checkpoint("llama", **checkpoint_options("vllm"))


@pytest.mark.parametrize("arch", ARCHES)
def test_rows_equal_the_torch_backend_rows(arch: str, loaded, checkpoint) -> None:
    """Logits and probabilities within 1e-4 absolute of torch's, on every fixture arch."""
    torch_rows = build_backend("torch", checkpoint(arch, **checkpoint_options("vllm")))
    expected = torch_rows.evaluate(PROMPT)
    backend = loaded("vllm", arch)
    rows = np.concatenate(
        [backend.evaluate(PROMPT[:7])] + [backend.evaluate([t]) for t in PROMPT[7:]]
    )
    assert backend.identity == torch_rows.identity
    np.testing.assert_allclose(rows, expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(softmax64(rows), softmax64(expected), rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHES)
def test_capture_rows_equal_the_torch_backend_capture(arch: str, loaded, checkpoint) -> None:
    """issue 32: the layer outputs vLLM's worker keeps (its decoder layer's hidden plus the
    residual it hands on) are torch's capture, over a prompt and then rounds that reuse the
    cached KV; the logits stay the plain rows, and a later evaluate captures nothing."""
    torch_rows = build_backend("torch", checkpoint(arch, **checkpoint_options("vllm")))
    layers = list(range(torch_rows.num_layers))
    want_logits, want = torch_rows.evaluate_capture(LONG[:70], layers)
    backend = loaded("vllm", arch)
    steps = [(0, 40), (40, 45), (45, 46), (46, 70)]
    got = [backend.evaluate_capture(LONG[a:b], layers) for a, b in steps]
    assert backend.full_recomputes == 0
    logits = np.concatenate([g[0] for g in got])
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-4)
    for i in layers:
        rows = np.concatenate([g[1][i] for g in got])
        assert rows.dtype == np.float32 and rows.shape == want[i].shape
        scale = np.abs(want[i]).max()
        assert np.abs(rows - want[i]).max() <= 1e-5 * max(1.0, scale), f"layer {i}"
    assert np.abs(want[0] - want[layers[-1]]).max() > 0.1  # distinct layers
    assert backend.evaluate(LONG[70:72]).shape == (2, backend.vocab_size)
    _, none = backend.evaluate_capture(LONG[72:73], [])
    assert none == {}


@pytest.mark.parametrize("layer", [-1, 99])
def test_a_capture_layer_out_of_range_is_refused_and_nothing_is_held(layer, loaded) -> None:
    backend = loaded("vllm")
    backend.evaluate(LONG[:3])
    with pytest.raises(CaptureLayerError, match=rf"layer {layer} outside \[0, 2\)"):
        backend.evaluate_capture(LONG[3:5], [0, layer])
    assert backend.length == 3


TREE_PARENTS = [-1, -1, -1, 0, 0, 3, 1, 6, 7]  # three root children, four leaves, depth 1 to 4
TREE_TOKENS = [11, 12, 13, 21, 22, 31, 41, 51, 61]


def each_row_is_its_paths(rows, path_to_model, transcript, tokens, parents) -> None:
    """Each tree row (0: the root, i + 1: node i) is the float64 reference's row after the
    transcript and that entry's own path."""
    for entry in range(1 + len(tokens)):
        path, e = [], entry
        while e > 0:
            path.append(tokens[e - 1])
            e = parents[e - 1] + 1
        reference = float64_rows(path_to_model, [*transcript, *reversed(path)])[-1]
        np.testing.assert_allclose(rows[entry], reference, rtol=0, atol=1e-4, err_msg=f"{entry}")


def test_a_token_tree_gives_each_node_its_own_paths_row(loaded, vllm_path) -> None:
    """issue 33: a tree after a 70-token transcript, a request per root-to-leaf path over
    the prefix cache, all in one engine step. Every row (root and nodes) is the float64
    reference's row of that node's own path; the held tokens do not move until keep_path
    keeps one path, and the next round's rows follow that path."""
    backend = loaded("vllm")
    transcript = LONG[:70]
    backend.evaluate(transcript[:-1])
    root = transcript[-1]
    before, calls = backend.engine_tokens, backend.engine_calls
    rows = backend.evaluate_tree(backend, [root, *TREE_TOKENS], TREE_PARENTS)
    assert backend.engine_calls == calls + 1  # every path in one engine step
    assert rows.shape == (1 + len(TREE_TOKENS), backend.vocab_size)
    assert backend.length == 69 and backend.full_recomputes == 0
    leaves = 4  # nodes 2, 4, 5 and 8: per path a partial block and the path, never the context
    assert backend.engine_tokens - before <= leaves * (backend.block_size - 1 + 5)
    each_row_is_its_paths(rows, vllm_path, transcript, TREE_TOKENS, TREE_PARENTS)
    backend.keep_path([1, 6, 7])  # root, 12, 41, 51
    kept = [*transcript, 12, 41, 51]
    assert backend.length == len(kept)
    after = backend.evaluate([7])
    np.testing.assert_allclose(after[0], float64_rows(vllm_path, [*kept, 7])[-1], rtol=0, atol=1e-4)


def test_a_token_tree_captures_each_entrys_rows_of_its_path(loaded, checkpoint) -> None:
    """A capturing session's tree on vLLM (`evaluate_tree_capture`): every entry's capture
    rows, from the same one engine step, are torch's rows of that entry's own path, and
    so are the logits; a path that goes again alone brings its rows too."""
    torch_rows = build_backend("torch", checkpoint("llama", **checkpoint_options("vllm")))
    layers = [1, 0]
    backend = loaded("vllm")
    transcript = LONG[:70]
    backend.evaluate(transcript[:-1])
    tree = [transcript[-1], *TREE_TOKENS]
    calls = backend.engine_calls
    rows, captured = backend.evaluate_tree_capture(backend, tree, TREE_PARENTS, layers)
    assert backend.engine_calls == calls + 1 and sorted(captured) == [0, 1]
    np.testing.assert_allclose(rows, backend.evaluate_tree(backend, tree, TREE_PARENTS),
                               rtol=0, atol=1e-5)  # fmt: skip
    for entry in range(len(tree)):
        path, e = [], entry
        while e > 0:
            path.append(TREE_TOKENS[e - 1])
            e = TREE_PARENTS[e - 1] + 1
        torch_rows.reset()
        _, want = torch_rows.evaluate_capture([*transcript, *reversed(path)], layers)
        for i in layers:
            assert captured[i].shape == (len(tree), backend.geometry.hidden_size)
            scale = max(1.0, float(np.abs(want[i][-1]).max()))
            assert np.abs(captured[i][entry] - want[i][-1]).max() <= 1e-5 * scale, (entry, i)
    real = backend._run_paths
    backend._run_paths = lambda base, paths, ids: [
        g if k != 1 else None for k, g in enumerate(real(base, paths, ids))
    ]
    try:
        _, again = backend.evaluate_tree_capture(backend, tree, TREE_PARENTS, layers)
    finally:
        backend._run_paths = real
    for i in layers:
        np.testing.assert_allclose(again[i], captured[i], rtol=0, atol=1e-5)


def test_tree_paths_whose_rows_did_not_come_go_alone(loaded, monkeypatch) -> None:
    """The worker answers None for a path it cannot tell apart; that path goes again as a
    request of its own and the rows are the same."""
    backend = loaded("vllm")
    backend.evaluate(LONG[:69])
    tree = [LONG[69], *TREE_TOKENS]
    together = backend.evaluate_tree(backend, tree, TREE_PARENTS)
    real = backend._run_paths

    def second_lost(base, paths, ids):
        got = real(base, paths, ids)
        return [g if i != 1 else None for i, g in enumerate(got)]

    monkeypatch.setattr(backend, "_run_paths", second_lost)
    calls = backend.engine_calls
    again = backend.evaluate_tree(backend, tree, TREE_PARENTS)
    assert backend.engine_calls == calls + 2  # the step, then the lost path alone
    np.testing.assert_allclose(again, together, rtol=0, atol=1e-5)


def test_tree_paths_sharing_a_full_block_past_the_held_tokens(loaded, vllm_path) -> None:
    """Two paths that share root and three nodes after 60 held tokens fill the block
    [32, 64) alike, so the engine may serve one path's copy of it to the other in the same
    step (its run then starts at 64): every row still comes from that one step, each the
    reference row of its own path."""
    backend = loaded("vllm")
    transcript = LONG[:61]
    backend.evaluate(transcript[:-1])
    parents, tokens = [-1, 0, 1, 2, 2, 3, 4], [11, 12, 13, 21, 22, 31, 41]
    calls, recomputes = backend.engine_calls, backend.full_recomputes
    rows = backend.evaluate_tree(backend, [transcript[-1], *tokens], parents)
    assert backend.engine_calls == calls + 1 and backend.full_recomputes == recomputes
    each_row_is_its_paths(rows, vllm_path, transcript, tokens, parents)


def test_tree_refusals_leave_the_held_tokens(loaded) -> None:
    backend = loaded("vllm")
    backend.evaluate(LONG[:5])
    with pytest.raises(ValueError, match="keep_path: no tree is held"):
        backend.keep_path([0])
    with pytest.raises(ValueError, match="parent 3 is not -1"):
        backend.evaluate_tree(backend, [1, 2, 3], [-1, 3])
    with pytest.raises(TypeError, match="is not this backend"):
        backend.evaluate_tree(object(), [1, 2], [-1])
    backend.evaluate_tree(backend, [1, 2, 3], [-1, -1])
    with pytest.raises(ValueError, match="outside the tree's 2"):
        backend.keep_path([2])
    backend.rollback(1)  # a tree not kept is dropped by whatever the sequence does next
    with pytest.raises(ValueError, match="no tree is held"):
        backend.keep_path([0])
    assert backend.length == 4


def test_a_round_reuses_the_committed_kv(loaded, vllm_path) -> None:
    """Rounds of D+1 = 5 after a 150-token transcript, two drafts rejected in each: the
    engine computes the new tokens and at most block_size - 1 held ones, never the
    transcript again, and the kept rows are the float64 reference's."""
    backend = loaded("vllm")
    rng = np.random.default_rng(7)
    transcript = LONG[:150]
    backend.evaluate(transcript)
    recomputes, kept = backend.full_recomputes, []
    for _ in range(12):
        drafted = [int(t) for t in rng.integers(0, 320, 5)]  # a new frontier and 4 drafts
        before = backend.engine_tokens
        rows = backend.evaluate(drafted)
        computed = backend.engine_tokens - before
        assert 5 <= computed <= 5 + backend.block_size - 1, (len(transcript), computed)
        backend.rollback(2)
        transcript += drafted[:3]
        kept.append(rows[:3])
    assert backend.full_recomputes == recomputes
    reference = float64_rows(vllm_path, transcript)[150:]
    np.testing.assert_allclose(np.concatenate(kept), reference, rtol=0, atol=1e-4)


def test_rollback_across_cached_blocks_then_reevaluate(loaded) -> None:
    """Rewind 100 tokens and evaluate them again: their KV blocks are still cached, so
    the backend recomputes without the cache (counted) and the rows come back the same."""
    backend = loaded("vllm")
    first = backend.evaluate(LONG[:40])
    rest = backend.evaluate(LONG[40:140])
    recomputes = backend.full_recomputes
    backend.rollback(100)
    again = backend.evaluate(LONG[40:140])
    assert backend.full_recomputes == recomputes + 1
    np.testing.assert_allclose(again, rest, rtol=0, atol=1e-5)
    backend.rollback(100)
    other = backend.evaluate([t + 1 for t in LONG[40:140]])  # a different continuation
    assert backend.full_recomputes == recomputes + 1
    assert other.shape == rest.shape and np.abs(other - rest).max() > 0.1
    backend.reset()
    np.testing.assert_allclose(backend.evaluate(LONG[:40]), first, rtol=0, atol=1e-5)


def test_loader_builds_it_and_context_override_moves_the_refusal(vllm_path) -> None:
    from verifier_gx.backends import load_target_backend
    from verifier_gx.backends.vllm_backend import VllmBackend, default_kv_cache_bytes

    backend = load_target_backend("vllm", vllm_path, context_length=8)
    assert type(backend) is VllmBackend and backend.geometry.context_length == 8
    assert backend.device_label == "vllm:cpu"
    assert backend.kv_cache_bytes == default_kv_cache_bytes(vllm_path, 8) == 64 << 20
    backend.evaluate(PROMPT[:8])
    with pytest.raises(ContextOverflowError, match=r"9 tokens.*context_length is 8"):
        backend.evaluate([PROMPT[8]])
    assert backend.length == 8
    backend.rollback(1)
    assert backend.evaluate([PROMPT[8]]).shape == (1, 320)


def test_default_kv_pool_is_sized_from_the_checkpoint(vllm_path) -> None:
    """Not vLLM's CPU default (most of the RAM): KV_SEQUENCES full contexts at 4 bytes a
    value, at least 64 MiB."""
    from verifier_gx.backends.vllm_backend import KV_SEQUENCES, default_kv_cache_bytes

    per_token = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32, float32
    assert default_kv_cache_bytes(vllm_path, 32768) == KV_SEQUENCES * 32769 * per_token
    assert default_kv_cache_bytes(vllm_path, 256) == 64 << 20


def test_the_whole_checkpoint_context_fits(loaded) -> None:
    backend = loaded("vllm")
    assert backend.geometry.context_length == 256
    backend.evaluate([7] * 256)
    with pytest.raises(ContextOverflowError, match="257 tokens.*context_length is 256"):
        backend.evaluate([7])


def test_context_override_past_the_checkpoint_matches_the_reference(loaded, vllm_path) -> None:
    backend = loaded("vllm", context_length=300)
    tokens = (LONG * 2)[:300]
    rows = np.concatenate([backend.evaluate(tokens[:290]), backend.evaluate(tokens[290:])])
    np.testing.assert_allclose(rows, float64_rows(vllm_path, tokens), rtol=0, atol=1e-4)


def test_rope_theta_override_matches_the_reference(loaded, vllm_path) -> None:
    rope = {"rope_theta": 500.0, "rope_type": "default"}
    rows = loaded("vllm", rope_theta=500.0).evaluate(PROMPT)
    reference = float64_rows(vllm_path, PROMPT, rope_parameters=rope)
    np.testing.assert_allclose(rows, reference, rtol=0, atol=1e-4)
    assert np.abs(rows - loaded("vllm").evaluate(PROMPT)).max() > 0.1


def test_dtype_option_takes_effect_and_rows_stay_float64(loaded) -> None:
    rows = loaded("vllm", dtype="bfloat16").evaluate(PROMPT)
    reference = loaded("vllm").evaluate(PROMPT)
    assert rows.dtype == np.float64
    difference = np.abs(rows - reference).max()
    assert 0 < difference < 0.5, difference


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("device", "cuda", "device 'cuda' refused: this vLLM build runs on 'cpu'"),
        ("dtype", "float64", "'float64' is not one of"),
        ("block_size", 0, "block_size 0 is invalid"),
        ("kv_cache_bytes", 1.5, "kv_cache_bytes 1.5 is invalid"),
    ],
)
def test_bad_options_refused_before_the_engine_starts(vllm_path, option, value, message):
    from verifier_gx.backends.vllm_backend import VllmBackend

    with pytest.raises(InvalidOverrideError, match=message):
        VllmBackend(vllm_path, **{option: value})


def test_engine_in_its_own_processes_gives_the_same_rows(loaded, vllm_path) -> None:
    """engine_process=True: the hook runs in vLLM's worker process; rows cross as bytes."""
    expected = loaded("vllm").evaluate(PROMPT)
    backend = build_backend("vllm", vllm_path, engine_process=True)
    rows = np.concatenate([backend.evaluate(PROMPT[:10]), backend.evaluate(PROMPT[10:])])
    np.testing.assert_array_equal(rows, expected)
    backend.rollback(6)
    np.testing.assert_array_equal(backend.evaluate(PROMPT[10:]), expected[10:])
