"""The feature-conditioned draft's network in PyTorch (EAGLE-3 style; docs/conditioned.md).

Per position p the draft reads the token x_p and one *feature* row: the target's hidden rows
after x_{p-1} at the capture layers, concatenated, normalised and fused to the draft's width
(`fuse`), or, where the target has not computed them yet (a drafted token), the draft's own
output row at p-1. One decoder layer of the target's shape (grouped-query attention with
RoPE, SwiGLU MLP) turns [norm(embed(x_p)), norm(feature)] into the output row, and a head
over a reduced vocabulary (`head_ids`, the tokens the target actually predicts) scores x_{p+1}.
The embedding is the target's, frozen; the head starts from its rows.

This module is the network only (STYLE.md item 16): the proposer's loop, the KV and the
features' bookkeeping live in `proposer_mac.backends.conditioned`; the trainer in
`muser_app.fixtures.conditioned`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from proposer_mac.backends.conditioned_meta import ConditionedSpec


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Llama's half-split layout) of x (B, heads, S, head_dim) at
    `positions` (S,) or (B, S)."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = positions.to(torch.float32)[..., None] * inv  # (.., S, half)
    if angles.dim() == 2:
        angles = angles[None]
    cos, sin = torch.cos(angles)[:, None], torch.sin(angles)[:, None]  # (B|1, 1, S, half)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class ConditionedNet(nn.Module):
    def __init__(self, spec: ConditionedSpec) -> None:
        super().__init__()
        self.spec = spec
        width, eps = spec.hidden_size, spec.rms_norm_eps
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.embed = nn.Embedding(spec.vocab_size, spec.target_hidden_size)
        self.embed.weight.requires_grad_(False)
        feature_width = spec.target_hidden_size * len(spec.capture_layers)
        self.feature_norm = RMSNorm(feature_width, eps)
        self.fuse = nn.Linear(feature_width, width, bias=False)
        self.token_norm = RMSNorm(spec.target_hidden_size, eps)
        self.hidden_norm = RMSNorm(width, eps)
        self.input = nn.Linear(spec.target_hidden_size + width, width, bias=False)
        self.attn_norm = RMSNorm(width, eps)
        self.q = nn.Linear(width, heads * dim, bias=False)
        self.k = nn.Linear(width, kv_heads * dim, bias=False)
        self.v = nn.Linear(width, kv_heads * dim, bias=False)
        self.o = nn.Linear(heads * dim, width, bias=False)
        self.mlp_norm = RMSNorm(width, eps)
        self.gate = nn.Linear(width, spec.intermediate_size, bias=False)
        self.up = nn.Linear(width, spec.intermediate_size, bias=False)
        self.down = nn.Linear(spec.intermediate_size, width, bias=False)
        self.norm = RMSNorm(width, eps)
        self.head = nn.Linear(width, spec.head_size, bias=False)
        self.register_buffer("head_ids", torch.zeros(spec.head_size, dtype=torch.long))
        """The target vocabulary id of each head row (saved with the weights)."""

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated capture rows (.., layers × target width) → a feature row."""
        return self.fuse(self.feature_norm(features))

    def forward(
        self,
        tokens: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One pass: tokens (B, S), feature rows (B, S, width), positions (S,) or (B, S),
        `allowed` (S, P + S) bool, which keys (the P past ones, then these) each row sees
        (or (B, 1, S, P + S): each sequence its own).
        Returns (output rows (B, S, width) — the next position's self feature —, head logits
        (B, S, reduced vocab), this pass's keys and values appended to `past`)."""
        spec = self.spec
        batch, length = tokens.shape
        x = self.input(
            torch.cat([self.token_norm(self.embed(tokens)), self.hidden_norm(feature)], -1)
        )
        h = self.attn_norm(x)
        q = self.q(h).view(batch, length, spec.num_heads, spec.head_dim).transpose(1, 2)
        k = self.k(h).view(batch, length, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        v = self.v(h).view(batch, length, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        q, k = rope(q, positions, spec.rope_theta), rope(k, positions, spec.rope_theta)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        group = spec.num_heads // spec.num_kv_heads
        keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
        x = x + self.o(att.transpose(1, 2).reshape(batch, length, -1))
        h = self.mlp_norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, self.head(self.norm(x)), (k, v)


class TorchEngine:
    """`ConditionedNet` for inference, numpy at the edges (the interface `ConditionedMlx`
    shares): the KV stays torch tensors."""

    def __init__(self, net: ConditionedNet) -> None:
        self.net = net.eval()
        self.head_ids = net.head_ids.numpy()

    def fuse_features(self, rows):
        with torch.inference_mode():
            return self.net.fuse_features(torch.from_numpy(rows)).numpy()

    def forward(self, tokens, feature, positions, allowed, past=None):
        with torch.inference_mode():
            outs, logits, kv = self.net(
                torch.from_numpy(tokens),
                torch.from_numpy(feature),
                torch.from_numpy(positions),
                torch.from_numpy(allowed),
                past,
            )
        return outs.numpy(), logits.numpy(), kv

    def forward_each(self, tokens, feature, positions, allowed, pasts):
        """`forward` for B sequences at once, one new position each (B, 1), each after its
        own `pasts[b]` (keys and values of any length, padded here into one batch):
        `allowed` (B, P + 1) says which of the P padded keys, then the new one, each sees.
        Returns the output rows, the logits and each sequence's past with its new key."""
        width = allowed.shape[1] - 1
        with torch.inference_mode():
            past = tuple(
                torch.cat([F.pad(kv[i], (0, 0, 0, width - kv[i].shape[2])) for kv in pasts])
                for i in (0, 1)
            )
            outs, logits, (k, v) = self.net(
                torch.from_numpy(tokens),
                torch.from_numpy(feature),
                torch.from_numpy(positions),
                torch.from_numpy(allowed)[:, None, None, :],
                past,
            )
            grown = [
                (torch.cat([pk, k[b : b + 1, :, width:]], 2),
                 torch.cat([pv, v[b : b + 1, :, width:]], 2))
                for b, (pk, pv) in enumerate(pasts)
            ]  # fmt: skip
        return outs.numpy(), logits.numpy(), grown

    def take(self, past, keys: list[int]):
        """`past`'s keys and values at the indices `keys`, in that order."""
        at = torch.as_tensor(keys, dtype=torch.long)
        return past[0][:, :, at], past[1][:, :, at]
