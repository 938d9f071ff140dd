"""A forward that fails part-way (out of memory at some layer) leaves the one-KV cache as it
was: the layers it reached are cut back, so a retry's rows are a fresh cache's, bit for bit.
Regression: the early layers kept the failed tokens' keys while `length` did not count them,
and a one-token retry returned rows off by ~0.8 without raising (a round judged against
them would be signed)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.cursor import KvCursor
from tests.backends.backend_helpers import build_backend

PREFIX = [int(t) for t in np.random.default_rng(0).integers(1, 60, 24)]


def fail_in_a_middle_layer(kind, backend, monkeypatch) -> None:
    """The next forward raises in decoder layer 1 of 2, after layer 0 updated its cache."""
    if kind == "torch":
        import torch

        real, calls = torch.nn.functional.linear, []

        def linear(*args, **kw):
            calls.append(1)
            if len(calls) == 9:  # layer 0's 7 projections, then into layer 1
                raise RuntimeError("CUDA out of memory (simulated)")
            return real(*args, **kw)

        monkeypatch.setattr(torch.nn.functional, "linear", linear)
    else:
        layer = backend._model.model.layers[1]
        cls, real_call = type(layer), type(layer).__call__

        def call(self, *args, **kw):
            if self is layer:
                raise RuntimeError("[metal] out of memory (simulated)")
            return real_call(self, *args, **kw)

        monkeypatch.setattr(cls, "__call__", call)


@pytest.mark.parametrize(
    ("kind", "opts"),
    [("torch", {}), ("torch", {"forward": "transformers"}), ("mlx", {})],
    ids=["torch-lean", "torch-transformers", "mlx"],
)
@pytest.mark.parametrize("width", [1, 3])
def test_a_retry_after_a_failed_forward_gives_a_fresh_caches_rows(
    checkpoint, monkeypatch, kind, opts, width
):
    path = checkpoint("llama")
    backend = build_backend(kind, path, **opts)
    cursor = KvCursor(backend)
    cursor.hold(PREFIX)
    nxt = [7, 11, 13][:width]
    with monkeypatch.context() as patch:
        fail_in_a_middle_layer(kind, backend, patch)
        with pytest.raises(RuntimeError, match="out of memory"):
            cursor.extend(nxt)
    assert backend.length == len(cursor.tokens) == len(PREFIX)
    fresh = build_backend(kind, path, **opts)
    fresh.evaluate(PREFIX)
    np.testing.assert_array_equal(cursor.extend(nxt), fresh.evaluate(nxt))
