"""The lean Llama forward (muser_torch/llama_forward.py): bit-equal rows to the
transformers forward on both torch paths, used only where that holds, off on request.

The two bit-equality tests also run in the vLLM environment (`make test-vllm`, marker
`vllm`), whose transformers is older: its differences (another mask keyword, no `pack_gqa`)
are where the lean forward once went wrong."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from muser_app.testing import ARCHES
from muser_torch import llama_forward
from tests.backends.backend_helpers import PROMPT, build_backend


def _pair(path, **opts):
    return (
        build_backend("torch", path, forward="lean", **opts),
        build_backend("torch", path, forward="transformers", **opts),
    )


def _also_in_vllm_env(*cases) -> list:
    """Each case, and each again marked `vllm` (run by `make test-vllm` in .venv-vllm)."""
    cases = [c if isinstance(c, tuple) else (c,) for c in cases]
    ids = ["-".join(map(str, c)) for c in cases]
    return [pytest.param(*c, id=i) for c, i in zip(cases, ids, strict=True)] + [
        pytest.param(*c, marks=pytest.mark.vllm, id=f"{i}-vllm-env")
        for c, i in zip(cases, ids, strict=True)
    ]


@pytest.mark.parametrize(
    ("arch", "rope_theta"),
    _also_in_vllm_env(
        ("llama", None), ("llama", 500.0), ("qwen2", None), ("qwen3", None), ("mistral", None)
    ),
)
def test_one_kv_rows_are_the_transformers_rows_bit_for_bit(checkpoint, arch, rope_theta) -> None:
    """Every tiny checkpoint has 4 query heads over 2 key/value heads: a prefill (attention's
    own causal flag), single tokens (one query) and chunks after a cache (a materialised mask)
    each take another branch of transformers' sdpa attention. qwen2 has biased q/k/v
    projections, qwen3 its per-head q/k norms."""
    lean, plain = _pair(checkpoint(arch), rope_theta=rope_theta)
    assert (lean.forward_kind, plain.forward_kind) == ("lean", "transformers")
    chunks = [PROMPT[:7], PROMPT[7:8], PROMPT[8:11], PROMPT[11:12], PROMPT[12:]]
    for chunk in chunks:
        assert np.array_equal(lean.evaluate(chunk), plain.evaluate(chunk)), chunk
    lean.rollback(6)
    plain.rollback(6)
    assert np.array_equal(lean.evaluate(PROMPT[3:9]), plain.evaluate(PROMPT[3:9]))


@pytest.mark.parametrize("arch", _also_in_vllm_env(*ARCHES))
def test_batched_rows_are_the_transformers_rows_bit_for_bit(checkpoint, arch) -> None:
    lean, plain = _pair(checkpoint(arch))
    assert lean.forward_kind == "lean"
    ours = [lean.sequence() for _ in range(3)]
    theirs = [plain.sequence() for _ in range(3)]
    steps = [
        [PROMPT[:5], PROMPT[:2], PROMPT[:9]],  # ragged prefills
        [PROMPT[5:6], PROMPT[2:3], PROMPT[9:10]],  # one query each
        [PROMPT[6:10], PROMPT[3:4]],  # ragged, one sequence sitting out
        [PROMPT[10:11]],  # alone
    ]
    for step in steps:
        a = lean.evaluate_batch(list(zip(ours, step, strict=False)))
        b = plain.evaluate_batch(list(zip(theirs, step, strict=False)))
        for x, y in zip(a, b, strict=True):
            assert x.shape == y.shape and np.array_equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_draft_step_takes_the_ragged_batch_inputs_by_a_shorter_way(checkpoint, dtype) -> None:
    """One token of one sequence (every draft step) gets its rows, positions and mask from
    three torch calls: the very tensors the ragged path builds, so the very rows."""
    import torch

    from muser_torch.batched import batch_inputs, ragged_inputs

    short, ragged = (build_backend("torch", checkpoint("llama"), dtype=dtype) for _ in range(2))
    mask = (short._mask_dtype, short._mask_lowest)
    ragged._inputs = lambda *batch: ragged_inputs(torch, *batch, *mask)  # every batch the long way
    a, b = short.sequence(), ragged.sequence()
    for seq in (a, b):
        seq.evaluate(PROMPT[:5])
    for t in PROMPT[5:12]:
        total = a.length + 1
        got = batch_inputs(torch, [a], [[t]], [1], total, *mask)
        want = ragged_inputs(torch, [a], [[t]], [1], total, *mask)
        for x, y in zip(got, want, strict=True):
            assert (x.dtype, x.shape) == (y.dtype, y.shape) and torch.equal(x, y)
        assert np.array_equal(a.evaluate([t]), b.evaluate([t]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights_are_bit_equal_too(checkpoint, dtype) -> None:
    lean, plain = _pair(checkpoint("qwen3"), dtype=dtype)
    assert lean.forward_kind == "lean"
    for chunk in (PROMPT[:6], PROMPT[6:7], PROMPT[7:10]):
        assert np.array_equal(lean.evaluate(chunk), plain.evaluate(chunk))


def test_captured_rows_come_from_the_transformers_forward(checkpoint) -> None:
    lean, plain = _pair(checkpoint("llama"))
    rows, hidden = lean.evaluate_capture(PROMPT[:6], [0, 1])
    ref_rows, ref_hidden = plain.evaluate_capture(PROMPT[:6], [0, 1])
    assert np.array_equal(rows, ref_rows)
    assert all(np.array_equal(hidden[i], ref_hidden[i]) for i in (0, 1))
    assert np.array_equal(lean.evaluate(PROMPT[6:8]), plain.evaluate(PROMPT[6:8]))


def test_forward_must_be_one_of_the_forwards(checkpoint) -> None:
    from muser.errors import InvalidOverrideError
    from verifier_gx.backends import load_target_backend

    want = r"forward 'fast' is invalid: expected one of auto, packed, lean, transformers"
    with pytest.raises(InvalidOverrideError, match=want):
        load_target_backend("torch", checkpoint("llama"), forward="fast")
    assert load_target_backend(
        "torch", checkpoint("llama"), forward="transformers"
    ).forward_kind == ("transformers")


def test_the_windowed_draft_reports_its_inner_forward(checkpoint) -> None:
    assert build_backend("windowed", checkpoint("llama")).forward_kind == "lean"
    assert build_backend("windowed", checkpoint("llama"), forward="transformers").forward_kind == (
        "transformers"
    )


def test_a_sliding_window_keeps_the_transformers_forward(checkpoint) -> None:
    """ "auto" falls back to the module tree; asking for the lean forward by name is refused
    with the reason, not silently ignored."""
    from muser.errors import InvalidOverrideError

    path = checkpoint("mistral", sliding_window=4)
    auto = build_backend("torch", path)
    plain = build_backend("torch", path, forward="transformers")
    assert auto.forward_kind == "transformers"
    assert llama_forward.supports(auto._model) == "sliding-window attention"
    assert np.array_equal(auto.evaluate(PROMPT[:9]), plain.evaluate(PROMPT[:9]))
    for named in ("lean", "packed"):
        with pytest.raises(InvalidOverrideError, match=rf"forward '{named}' refused for Mistral"
                           rf"ForCausalLM \({named}: sliding-window attention\)"):  # fmt: skip
            build_backend("torch", path, forward=named)


def test_a_lean_forward_that_disagrees_is_not_used(checkpoint, monkeypatch) -> None:
    """The load-time check is what guards exactness: a forward off by one float step on the
    logits must be caught. "auto" then runs the transformers rows (bfloat16: nothing to
    pack); "lean" by name is refused."""
    from muser.errors import InvalidOverrideError

    real = llama_forward.LeanLlama._layers

    def off(self, hidden, position_ids, mask, cache, keep=None):
        import torch

        out = real(self, hidden, position_ids, mask, cache, keep)
        return torch.nextafter(out, torch.full_like(out, float("inf")))  # one float step up

    monkeypatch.setattr(llama_forward.LeanLlama, "_layers", off)
    path = checkpoint("llama")
    backend = build_backend("torch", path, dtype="bfloat16")
    plain = build_backend("torch", path, dtype="bfloat16", forward="transformers")
    assert backend.forward_kind == "transformers"
    assert np.array_equal(backend.evaluate(PROMPT[:5]), plain.evaluate(PROMPT[:5]))
    with pytest.raises(InvalidOverrideError, match=r"lean: its one-KV rows differ from the "):
        build_backend("torch", path, forward="lean")


def test_the_load_check_covers_one_query_batches(checkpoint, monkeypatch) -> None:
    """transformers before 5.2x had no `pack_gqa`: a forward that fails only where one query
    per sequence meets a mask and grouped heads must fail the check, not a later round."""
    real = llama_forward.LeanLlama._attend

    def one_query_fails(self, q, k, v, mask):
        if q.shape[2] == 1 and mask is not None:
            raise AttributeError("no pack_gqa here")
        return real(self, q, k, v, mask)

    monkeypatch.setattr(llama_forward.LeanLlama, "_attend", one_query_fails)
    backend = build_backend("torch", checkpoint("llama"))
    assert backend.forward_kind == "transformers"
    seqs = [backend.sequence() for _ in range(2)]
    backend.evaluate_batch([(seqs[0], PROMPT[:3]), (seqs[1], PROMPT[:2])])
    backend.evaluate_batch([(seqs[0], PROMPT[3:4]), (seqs[1], PROMPT[2:3])])  # runs


LEAN_ARCHES = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


def _model(name="LlamaForCausalLM", **config):
    base = dict(
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        _attn_implementation="sdpa",
        rope_parameters={"rope_type": "default"},
        pretraining_tp=1,
    )
    base.update(config)
    return type(name, (), {"config": SimpleNamespace(**base)})()


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (_model(), None),
        (_model(rope_parameters={"rope_type": "llama3"}), None),
        (_model("Qwen3ForCausalLM", layer_types=["full_attention"] * 2), None),
        (_model(attention_bias=True), None),  # biased q/k/v/o: the bias goes to F.linear
        (_model("MistralForCausalLM", sliding_window=None), None),
        (
            _model("GPT2LMHeadModel"),
            "architecture GPT2LMHeadModel (lean forward: " + LEAN_ARCHES + ")",
        ),
        (_model(mlp_bias=True), "biased MLP projections"),
        (_model("MistralForCausalLM", sliding_window=4096), "sliding-window attention"),
        (_model("Qwen2ForCausalLM", layer_types=["sliding_attention"]), "sliding-window attention"),
        (_model(hidden_act="gelu"), "activation 'gelu'"),
        (_model(_attn_implementation="eager"), "attention implementation 'eager'"),
        (_model(rope_parameters={"rope_type": "dynamic"}), "rope type 'dynamic'"),
        (_model(pretraining_tp=2), "pretraining_tp > 1"),
    ],
)
def test_supports_names_what_it_does_not_model(model, reason) -> None:
    assert llama_forward.supports(model) == reason
