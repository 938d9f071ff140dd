"""A lean forward for Llama-family checkpoints (Llama, Mistral without a sliding window,
Qwen2, Qwen3): the same torch operations as transformers' modules for them, in the same order,
on the same loaded weights, without the per-module Python around them.

For the project's small models most of a transformers forward is Python: module calls,
decorators, output capture, mask and cache plumbing, a few hundred microseconds per decoder
layer while the arithmetic takes tens. This forward calls the torch functions that the
transformers modules call (`F.linear`, `F.embedding`, `F.scaled_dot_product_attention`, the
RMSNorm and rotary arithmetic written out as there, transformers' own sdpa helpers for
grouped heads and its own causal mask) on their very parameter tensors, so its logits are the
transformers logits bit for bit. `lean_forward` checks that on every load before the backend
uses it; a model where it does not hold keeps the transformers forward.

Two entry points, one per `TorchBackend` path: `logits` for the ragged batch (positions, an
additive float mask (B, 1, W, T) and a `_BatchKv` whose `update(k, v, layer)` stores the new
keys/values and returns the full ones) and `solo_logits` for one sequence on a transformers
`DynamicCache`. Loading stays transformers' own (`from_pretrained`); anything this file does
not model exactly (another architecture, a biased MLP, a sliding window, a rope type whose
inverse frequencies move with the length, another activation or attention implementation) is
refused by `supports`.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
"""One decoder layer shape: RMSNorm, attention (q/k/v/o projections, biased or not, Qwen3's
per-head q/k norms), RMSNorm, a SiLU-gated MLP; rotary positions; full causal attention."""


def supports(model: Any) -> str | None:
    """None when `LeanLlama` reproduces `model`'s forward; otherwise why not."""
    config = model.config
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"architecture {name} (lean forward: {', '.join(ARCHITECTURES)})"
    if getattr(config, "mlp_bias", False):
        return "biased MLP projections"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        return f"rope type {rope.get('rope_type')!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types or (
        name == "MistralForCausalLM" and getattr(config, "sliding_window", None) is not None
    ):
        return "sliding-window attention"
    return None


class LeanLlama:
    """`model`'s forward as plain torch calls on its own parameters (see the module note)."""

    def __init__(self, model: Any) -> None:
        import torch
        from transformers.integrations import sdpa_attention
        from transformers.masking_utils import create_causal_mask

        self._torch = torch
        self._F = torch.nn.functional
        self._sdpa = sdpa_attention
        self._causal_mask = create_causal_mask
        # transformers 5.2x renamed `past_key_values` to `cache` here too
        params = inspect.signature(create_causal_mask).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        base = model.model
        self.config = config = model.config
        self.embed = base.embed_tokens.weight
        self.padding_idx = base.embed_tokens.padding_idx
        self.layers = [_layer(layer) for layer in base.layers[: config.num_hidden_layers]]
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.lm_head = model.lm_head.weight
        self.head_dim = base.layers[0].self_attn.head_dim
        self.groups = base.layers[0].self_attn.num_key_value_groups
        self.scaling = base.layers[0].self_attn.scaling
        self.inv_freq = base.rotary_emb.inv_freq.to(dtype=torch.float)  # as `_layers` uses it
        self.rope_scaling = base.rotary_emb.attention_scaling

    def _rms(self, x, weight, eps):
        torch = self._torch
        dtype = x.dtype
        wide = dtype != torch.float32  # float32 needs no cast (each `to` is a torch call)
        if wide:
            x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * (x.to(dtype) if wide else x)

    def _rotate_half(self, x):
        half = x.shape[-1] // 2
        return self._torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def logits(self, input_ids, position_ids, mask, cache, keep: dict | None = None):
        """(B, W, V) logits of `input_ids` at `position_ids` after `cache`'s keys, under the
        additive `mask` (B, 1, W, T); `cache.update(k, v, layer)` stores and returns keys.
        `keep`: for each layer index it holds as a key, the (B, W, hidden) output of that
        decoder layer is put there (what a forward hook on the layer would read)."""
        hidden = self._F.embedding(input_ids, self.embed, self.padding_idx)
        return self._layers(hidden, position_ids, mask, cache, keep)

    def solo_logits(self, input_ids, cache):
        """One sequence (1, W) after a transformers `DynamicCache`: the positions and the
        mask transformers' `LlamaModel` makes for that call (none at all where attention's
        own causal flag or a single query does)."""
        torch = self._torch
        hidden = self._F.embedding(input_ids, self.embed, self.padding_idx)
        past = cache.get_seq_length()
        position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)
        mask = self._causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            position_ids=position_ids,
            **{self._cache_kwarg: cache},
        )
        return self._layers(hidden, position_ids, mask, cache)

    def _layers(self, hidden, position_ids, mask, cache, keep: dict | None = None):
        torch, F = self._torch, self._F
        inv_freq = self.inv_freq
        if inv_freq.device != hidden.device:
            inv_freq = self.inv_freq = inv_freq.to(device=hidden.device)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(hidden.dtype).unsqueeze(1)
        sin = (emb.sin() * self.rope_scaling).to(hidden.dtype).unsqueeze(1)
        batch, width = hidden.shape[:2]
        shape = (batch, width, -1, self.head_dim)
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = self._rms(hidden, *layer.ln1)
            q = F.linear(x, *layer.q).view(shape)
            k = F.linear(x, *layer.k).view(shape)
            if layer.q_norm is not None:  # Qwen3: an RMSNorm over each head, before rotary
                q, k = self._rms(q, *layer.q_norm), self._rms(k, *layer.k_norm)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = F.linear(x, *layer.v).view(shape).transpose(1, 2)
            q = (q * cos) + (self._rotate_half(q) * sin)
            k = (k * cos) + (self._rotate_half(k) * sin)
            k, v = cache.update(k, v, i)
            attn = self._attend(q, k, v, mask)
            hidden = residual + F.linear(attn.reshape(batch, width, -1).contiguous(), *layer.o)
            residual = hidden
            x = self._rms(hidden, *layer.ln2)
            gated = F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up)
            hidden = residual + F.linear(gated, layer.down)
            if keep is not None and i in keep:
                keep[i] = hidden
        hidden = self._rms(hidden, *self.norm)
        return F.linear(hidden, self.lm_head)

    def _attend(self, q, k, v, mask):
        """transformers' `sdpa_attention_forward`, step for step (its own helpers)."""
        sdpa = self._sdpa
        groups, q_length = self.groups, q.shape[2]
        extra = {}
        pack = getattr(sdpa, "pack_gqa", None)  # (transformers before 5.2x: none)
        if groups > 1:
            if sdpa.use_gqa_in_sdpa(mask, k, v):
                extra["enable_gqa"] = True
            elif q_length == 1 and pack is not None:  # a key/value head's queries ride the length
                q, mask = pack(q, groups), pack(mask, groups)
            else:
                k, v = sdpa.repeat_kv(k, groups), sdpa.repeat_kv(v, groups)
        is_causal = q_length > 1 and mask is None
        if is_causal and k.shape[2] > q_length:
            k, v = k[:, :, :q_length], v[:, :, :q_length]
        out = self._F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling, is_causal=is_causal, **extra
        )
        out = out.reshape(out.shape[0], -1, q_length, v.shape[-1])  # undoes the packing
        return out.transpose(1, 2).contiguous()


class _Layer(NamedTuple):
    ln1: tuple
    q: tuple  # (weight, bias or None): F.linear's arguments, as nn.Linear passes them
    k: tuple
    v: tuple
    o: tuple
    q_norm: tuple | None  # (weight, eps) of Qwen3's per-head norms; None elsewhere
    k_norm: tuple | None
    ln2: tuple
    gate: Any
    up: Any
    down: Any


def _layer(layer: Any) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp

    def linear(m):
        return (m.weight, m.bias)

    def norm(m):
        return None if m is None else (m.weight, m.variance_epsilon)

    return _Layer(
        norm(layer.input_layernorm),
        linear(attn.q_proj),
        linear(attn.k_proj),
        linear(attn.v_proj),
        linear(attn.o_proj),
        norm(getattr(attn, "q_norm", None)),
        norm(getattr(attn, "k_norm", None)),
        norm(layer.post_attention_layernorm),
        mlp.gate_proj.weight,
        mlp.up_proj.weight,
        mlp.down_proj.weight,
    )


def lean_forward(backend: Any, sequence: type) -> LeanLlama | None:
    """A `LeanLlama` for the `TorchBackend` `backend` when it reproduces the backend's model
    exactly, else None: supported, and its rows equal the transformers forward's bit for bit
    on both of the backend's paths, one KV (a prefill, one token, three more) and two
    `sequence`s in a batch (ragged prefills, ragged chunks, one query each): every branch
    transformers' attention takes for these calls; on the batched path the outputs of the
    layers it keeps (capture) equal too."""
    if supports(backend._model) is not None:
        return None
    torch, model = backend._torch, backend._model
    ids = [(7 * i + 3) % backend.vocab_size for i in range(12)]
    try:  # another transformers may lack a helper or an attribute read here: not ours then
        lean = LeanLlama(model)
        with torch.inference_mode():
            ours, theirs = backend._new_cache(), backend._new_cache()
            for chunk in (ids[:5], ids[5:6], ids[6:9]):
                x = torch.tensor([chunk], dtype=torch.long, device=backend.device)
                mine = lean.solo_logits(x, ours)
                ref = model(input_ids=x, use_cache=True, **{backend._cache_kwarg: theirs})
                if not torch.equal(mine, ref.logits):
                    return None
        rows = []
        layers = ([0, len(lean.layers) - 1], [0])  # captured rows too (hooks on theirs)
        for use in (lean, None):
            backend._lean = use
            a, b = sequence(backend), sequence(backend)  # (context_length unchecked)
            steps = ([ids[:5], ids[:2]], [ids[5:9], ids[2:3]], [ids[9:10], ids[3:4]])
            got = []
            for step in steps:
                logits, captured = backend._batch_rows([a, b], step, layers)
                got += [*logits, *(c[i] for c in captured for i in sorted(c))]
            rows.append(got)
    except (ImportError, TypeError, ValueError, RuntimeError, AttributeError, IndexError):
        return None
    finally:
        backend._lean = None
    pairs = list(zip(*rows, strict=True))
    same = all(x.shape == y.shape and (x == y).all() for x, y in pairs)
    return lean if same else None
