"""evaluate_capture: logits plus the output of chosen decoder layers (torch target)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import CaptureLayerError, RefusedError
from tests.backends.backend_helpers import PROMPT


def test_capture_shapes_and_unchanged_logits(loaded) -> None:
    backend = loaded("torch")
    plain = backend.evaluate(PROMPT)
    backend.reset()
    logits, hidden = backend.evaluate_capture(PROMPT[:10], [1, 0])
    assert sorted(hidden) == [0, 1]
    for states in hidden.values():
        assert states.shape == (10, backend.geometry.hidden_size)
        assert states.dtype == np.float32
    np.testing.assert_allclose(logits, plain[:10], rtol=0, atol=1e-5)
    step, more = backend.evaluate_capture(PROMPT[10:], [1])
    assert backend.length == len(PROMPT)
    assert more[1].shape == (len(PROMPT) - 10, backend.geometry.hidden_size)
    np.testing.assert_allclose(step, plain[10:], rtol=0, atol=1e-5)


def test_last_layer_capture_is_what_the_head_reads(loaded) -> None:
    """Final norm + lm_head applied to the last layer's capture reproduces the logits."""
    import torch

    backend = loaded("torch")
    last = backend.geometry.num_layers - 1
    logits, hidden = backend.evaluate_capture(PROMPT, [last, 0])
    model = backend._model
    with torch.no_grad():
        h = torch.from_numpy(hidden[last])
        again = model.lm_head(model.model.norm(h)).double().numpy()
    np.testing.assert_allclose(again, logits, rtol=0, atol=1e-5)
    assert np.abs(hidden[0] - hidden[last]).max() > 0.1  # distinct layers, not one tensor


def test_capture_layers_are_the_decoder_layer_outputs(loaded, llama) -> None:
    """Layer i's capture equals hidden_states[i + 1] of an uncached float64 forward."""
    import torch
    from transformers import AutoModelForCausalLM

    backend = loaded("torch")
    _, hidden = backend.evaluate_capture(PROMPT, [0])
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64).eval()
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), output_hidden_states=True)
    np.testing.assert_allclose(hidden[0], out.hidden_states[1][0].numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("layer", [-1, 2, 99])
def test_capture_layer_out_of_range_refused(layer: int, loaded) -> None:
    backend = loaded("torch")
    backend.evaluate(PROMPT[:3])
    with pytest.raises(CaptureLayerError, match=rf"layer {layer} outside \[0, 2\)") as info:
        backend.evaluate_capture(PROMPT[3:5], [0, layer])
    assert isinstance(info.value, RefusedError)
    assert backend.length == 3


@pytest.mark.parametrize("forward", ["packed", "lean", "transformers"])
def test_a_batch_captures_each_sequences_own_layers_as_each_alone(llama, forward) -> None:
    """`evaluate_batch_capture`: sequences of different lengths, each with its own layers
    (one none), in one forward: each gets its rows and its layers' rows as its own forward
    gives them (within a batch's float rounding), and nothing of another's layers. The
    packed forward, asked for by name, packs every projection of the tiny checkpoint."""
    from muser_torch.backend import TorchBackend

    backend = TorchBackend(llama, forward=forward)
    assert backend.forward_kind == forward
    work = [(PROMPT[:7], [1, 0]), (PROMPT[3:5], []), (PROMPT[:12], [1])]
    seqs = [backend.sequence() for _ in work]
    for seq, (tokens, _) in zip(seqs, work, strict=True):  # a ragged history first
        seq.evaluate(tokens[:2])
    got = backend.evaluate_batch_capture(
        [(seq, tokens[2:], layers) for seq, (tokens, layers) in zip(seqs, work, strict=True)]
    )
    for (tokens, layers), (rows, captured) in zip(work, got, strict=True):
        alone = backend.sequence()
        alone.evaluate(tokens[:2])
        ref_rows, ref = alone.evaluate_capture(tokens[2:], layers)
        assert sorted(captured) == sorted(layers)
        np.testing.assert_allclose(rows, ref_rows, rtol=0, atol=1e-5)
        for layer in layers:
            assert captured[layer].shape == (len(tokens) - 2, backend.geometry.hidden_size)
            np.testing.assert_allclose(captured[layer], ref[layer], rtol=0, atol=1e-5)
    assert [s.length for s in seqs] == [len(t) for t, _ in work]


def test_a_batch_refuses_a_layer_out_of_range_and_moves_no_sequence(loaded) -> None:
    backend = loaded("torch")
    a, b = backend.sequence(), backend.sequence()
    with pytest.raises(CaptureLayerError, match=r"layer 5 outside \[0, 2\)"):
        backend.evaluate_batch_capture([(a, PROMPT[:3], [0]), (b, PROMPT[:2], [5])])
    assert (a.length, b.length) == (0, 0)
