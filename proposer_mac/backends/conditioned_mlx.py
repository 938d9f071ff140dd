"""The feature-conditioned draft's network on MLX (Metal on a Mac, CPU elsewhere): the same
function as `conditioned_torch.ConditionedNet`, from the same weights, step for step (rows
within 1e-4: tests/proposer/test_conditioned.py). Inference only; training is torch's."""

from __future__ import annotations

import numpy as np

from proposer_mac.backends.conditioned_meta import ConditionedSpec


class ConditionedMlx:
    """`ConditionedNet.forward` and `fuse_features` over MLX arrays (numpy at the edges)."""

    def __init__(self, spec: ConditionedSpec, state: dict[str, np.ndarray], device: str) -> None:
        import mlx.core as mx

        self._mx = mx
        self.spec = spec
        self._stream = mx.gpu if device == "gpu" else mx.cpu
        self.w = {name: mx.array(value) for name, value in state.items()}
        self.head_ids = np.asarray(state["head_ids"], dtype=np.int64)
        half = spec.head_dim // 2
        self._inv = mx.array(1.0 / (spec.rope_theta ** (np.arange(half, dtype=np.float32) / half)))

    def _norm(self, name: str, x):
        return self._mx.fast.rms_norm(x, self.w[f"{name}.weight"], self.spec.rms_norm_eps)

    def _linear(self, name: str, x):
        return x @ self.w[f"{name}.weight"].T

    def _rope(self, x, positions):
        mx = self._mx
        angles = positions.astype(mx.float32)[..., None] * self._inv  # (S | B S, half)
        if angles.ndim == 3:
            angles = angles[:, None]  # (B, 1, S, half): one row of positions per sequence
        cos, sin = mx.cos(angles), mx.sin(angles)
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def fuse_features(self, rows: np.ndarray) -> np.ndarray:
        mx = self._mx
        with mx.stream(self._stream):
            x = self._linear("fuse", self._norm("feature_norm", mx.array(rows)))
            return np.array(x)

    def forward(self, tokens: np.ndarray, feature: np.ndarray, positions: np.ndarray,
                allowed: np.ndarray, past=None):  # fmt: skip
        """As `ConditionedNet.forward`: (output rows, head logits) as numpy, and the keys and
        values (MLX arrays) appended to `past`."""
        mx, spec = self._mx, self.spec
        with mx.stream(self._stream):
            batch, length = tokens.shape
            embedded = self.w["embed.weight"][mx.array(tokens)]
            x = mx.concatenate(
                [self._norm("token_norm", embedded), self._norm("hidden_norm", mx.array(feature))],
                axis=-1,
            )
            x = self._linear("input", x)
            h = self._norm("attn_norm", x)

            def heads(name: str, count: int):
                return (
                    self._linear(name, h)
                    .reshape(batch, length, count, spec.head_dim)
                    .transpose(0, 2, 1, 3)
                )

            pos = mx.array(positions)
            q = self._rope(heads("q", spec.num_heads), pos)
            k = self._rope(heads("k", spec.num_kv_heads), pos)
            v = heads("v", spec.num_kv_heads)
            if past is not None:
                k, v = mx.concatenate([past[0], k], axis=2), mx.concatenate([past[1], v], axis=2)
            att = mx.fast.scaled_dot_product_attention(
                q, k, v, scale=spec.head_dim**-0.5, mask=mx.array(allowed)
            )
            x = x + self._linear("o", att.transpose(0, 2, 1, 3).reshape(batch, length, -1))
            h = self._norm("mlp_norm", x)
            gate = self._linear("gate", h)
            x = x + self._linear("down", gate * mx.sigmoid(gate) * self._linear("up", h))
            logits = self._linear("head", self._norm("norm", x))
            mx.eval(x, logits, k, v)
            return np.array(x), np.array(logits), (k, v)

    def forward_each(self, tokens, feature, positions, allowed, pasts):
        """As `TorchEngine.forward_each`: B sequences, one new position each, each after its
        own past (padded here into one batch)."""
        mx = self._mx
        width = allowed.shape[1] - 1
        with mx.stream(self._stream):
            past = tuple(
                mx.concatenate(
                    [
                        mx.pad(kv[i], [(0, 0), (0, 0), (0, width - kv[i].shape[2]), (0, 0)])
                        for kv in pasts
                    ]
                )
                for i in (0, 1)
            )
        outs, logits, (k, v) = self.forward(
            tokens, feature, positions, allowed[:, None, None, :], past
        )
        with mx.stream(self._stream):
            grown = [
                (mx.concatenate([pk, k[b : b + 1, :, width:]], axis=2),
                 mx.concatenate([pv, v[b : b + 1, :, width:]], axis=2))
                for b, (pk, pv) in enumerate(pasts)
            ]  # fmt: skip
            mx.eval(grown)
        return outs, logits, grown

    def take(self, past, keys: list[int]):
        """`past`'s keys and values at the indices `keys`, in that order."""
        mx = self._mx
        with mx.stream(self._stream):
            at = mx.array(np.asarray(keys, dtype=np.int32))
            return mx.take(past[0], at, axis=2), mx.take(past[1], at, axis=2)
