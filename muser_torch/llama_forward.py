"""A lean forward for Llama-family checkpoints (Llama, Mistral without a sliding window,
Qwen2, Qwen3): the same torch operations as transformers' modules for them, in the same order,
on the same loaded weights, without the per-module Python around them.

For the project's small models most of a transformers forward is Python: module calls,
decorators, output capture, mask and cache plumbing, a few hundred microseconds per decoder
layer while the arithmetic takes tens. This forward calls the torch functions that the
transformers modules call (`F.linear`, `F.embedding`, `F.scaled_dot_product_attention`, the
RMSNorm and rotary arithmetic written out as there, transformers' own sdpa helpers for
grouped heads and its own causal mask) on their very parameter tensors, so its logits are the
transformers logits bit for bit. `checked_forward` checks that on every load before the backend
uses it; a model where it does not hold keeps the transformers forward. `PackedLlama` is the
same forward over weights reordered once for oneDNN (CPU, float32): rows within rounding of
the transformers rows, a few-row product at the price of one (`choose_forward` picks).

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
import threading
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

    def _linear(self, x, weight, bias=None):
        return self._F.linear(x, weight, bias)

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

    def solo_logits(self, input_ids, cache, keep: dict | None = None):
        """One sequence (1, W) after a transformers `DynamicCache`: the positions and the
        mask transformers' `LlamaModel` makes for that call (none at all where attention's
        own causal flag or a single query does). `keep` as for `logits`."""
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
        return self._layers(hidden, position_ids, mask, cache, keep)

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
            q = self._linear(x, *layer.q).view(shape)
            k = self._linear(x, *layer.k).view(shape)
            if layer.q_norm is not None:  # Qwen3: an RMSNorm over each head, before rotary
                q, k = self._rms(q, *layer.q_norm), self._rms(k, *layer.k_norm)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = self._linear(x, *layer.v).view(shape).transpose(1, 2)
            q = (q * cos) + (self._rotate_half(q) * sin)
            k = (k * cos) + (self._rotate_half(k) * sin)
            k, v = cache.update(k, v, i)
            attn = self._attend(q, k, v, mask)
            hidden = residual + self._linear(attn.reshape(batch, width, -1).contiguous(), *layer.o)
            residual = hidden
            x = self._rms(hidden, *layer.ln2)
            gated = F.silu(self._linear(x, layer.gate)) * self._linear(x, layer.up)
            hidden = residual + self._linear(gated, layer.down)
            if keep is not None and i in keep:
                keep[i] = hidden
        hidden = self._rms(hidden, *self.norm)
        return self._linear(hidden, self.lm_head)

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


FORWARDS = ("auto", "packed", "lean", "transformers")
"""`TorchBackend(forward=...)`: "packed" and "lean" are the classes here, "transformers" the
module tree, "auto" the first of packed, lean, transformers that holds for the model."""

PACK_MIN_ELEMENTS = 1 << 18
""""auto" packs a model whose largest matrix (a projection, or the embedding that is its tied
head) has this many elements (SmolLM2's 576 × 576 is 331,776): below it oneDNN's call costs more than MKL's unpacked product saves, and the tiny
models run faster lean (one thread, measured: docs/backends.md "The packed forward")."""

PACKED_TOLERANCE = 1e-3
"""The load check's bound on |packed − transformers| over logits and captured rows, relative
and absolute (`torch.allclose`): a wrong weight or a lost bias misses it by orders; the
reordered arithmetic's rounding (~1e-4 on a 30-layer model's logits) sits far inside it."""


MIN_ROWS = 4
"""The packed product runs at least this many rows (a shorter input padded with copies of its
last row, whose outputs are dropped). oneDNN gives a row the same bits for any count of rows
from 2 up but sums a lone row in another order, and 4 rows cost less than 1, 2 or 3 (the
real pair's 211 projections, one thread: 1 row 41.8 ms, 2 47.9, 3 38.1, 4 34.5, 5 34.7)."""


class _Packed(NamedTuple):
    weight: Any  # the oneDNN-reordered copy of a projection's weight (out, in)


class PackedLlama(LeanLlama):
    """`LeanLlama` over projection weights reordered once, at load, into oneDNN's blocked
    layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing does), and
    with attention taken one query at a time. Two things follow.

    Speed: a few-row product streams each weight once instead of repacking it on every
    call, so a 5-position verify of a 135 M model costs about one decode, not two.

    Invariance: a row depends only on the tokens it sees, never on what shares its forward.
    The packed product gives a row the same bits whatever the other rows (inputs under
    MIN_ROWS rows are padded: oneDNN's one-row kernel sums in another order), and each
    query attends alone, through the same kernel call a lone decode of it makes, to exactly
    the keys it sees (a prefix as a slice, a tree node's ancestors gathered in order). The
    rest is row-wise. So one-token decode, a verify chunk, a whole prefill, a ragged batch
    of sessions and a tree's path all give one position bit-equal rows: a lane's rows are
    plain decode's, and a verifier re-prefilling after a crash rebuilds the very keys.
    `checked_forward` holds both on load: rows within PACKED_TOLERANCE of the transformers
    forward, and the one-KV and batched paths bit-equal to each other. CPU, float32 only
    (`packing_refusal`)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        torch = self._torch
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self._pointwise = torch.ops.mkldnn._linear_pointwise

        def pack(weight):
            with torch.no_grad():
                return _Packed(reorder(weight.detach()))

        def linear(pair):
            return (pack(pair[0]), pair[1])

        self.layers = [
            layer._replace(
                q=linear(layer.q),
                k=linear(layer.k),
                v=linear(layer.v),
                o=linear(layer.o),
                gate=pack(layer.gate),
                up=pack(layer.up),
                down=pack(layer.down),
            )
            for layer in self.layers
        ]
        self.lm_head = pack(self.lm_head)
        # `_keys_seen`'s last plan and the mask (or shape) it was made for, per thread: forks
        # of one backend share this object, and two threads may each run a forward
        self._plans = threading.local()

    def _linear(self, x, weight, bias=None):
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        if count < MIN_ROWS:  # the many-row kernel, for one row too (MIN_ROWS)
            rows = self._torch.cat((rows, rows[-1:].expand(MIN_ROWS - count, -1)))
        out = self._pointwise(rows, weight.weight, bias, "none", [], "")[:count]
        return out.view(*x.shape[:-1], out.shape[-1])

    def _keys_seen(self, mask, batch: int, width: int, length: int) -> list:
        """For each (row, query), the keys it attends to: a count n (keys [0, n)) or the
        ascending indices of the ones it sees. Made once a forward (every layer shares the
        mask). No mask: the queries are the last `width` positions, causal."""
        key = mask if mask is not None else (batch, width, length)
        made_for = getattr(self._plans, "made_for", None)
        if made_for is not None and (made_for is key if mask is not None else made_for == key):
            return self._plans.plan
        torch = self._torch
        if mask is None:
            plan = [[length - width + j + 1 for j in range(width)] for _ in range(batch)]
        else:
            seen = (mask if mask.dtype == torch.bool else mask == 0)[:, 0].expand(
                batch, width, length
            )
            counts = seen.sum(-1)
            firsts = seen.cumsum(-1).gather(-1, (counts - 1).clamp(min=0).unsqueeze(-1))
            prefix = (firsts.squeeze(-1) == counts).tolist()
            counts = counts.tolist()
            plan = [
                [
                    counts[b][j] if prefix[b][j] else seen[b, j].nonzero().squeeze(-1)
                    for j in range(width)
                ]
                for b in range(batch)
            ]
        self._plans.made_for, self._plans.plan = key, plan
        return plan

    def _attend(self, q, k, v, mask):
        """Each query alone over the keys it sees (`_keys_seen`): the call a lone decode of
        that position makes."""
        batch, heads, width, dim = q.shape
        plan = self._keys_seen(mask, batch, width, k.shape[2])
        sdpa, grouped = self._F.scaled_dot_product_attention, self.groups > 1
        out = q.new_empty((batch, width, heads, dim))
        for b, row in enumerate(plan):
            for j, seen in enumerate(row):
                if isinstance(seen, int):
                    keys, values = k[b : b + 1, :, :seen], v[b : b + 1, :, :seen]
                else:
                    keys, values = k[b : b + 1, :, seen], v[b : b + 1, :, seen]
                one = sdpa(q[b : b + 1, :, j : j + 1], keys, values, scale=self.scaling,
                           enable_gqa=grouped)  # fmt: skip
                out[b, j] = one[0, :, 0]
        return out


def packing_refusal(backend: Any) -> str | None:
    """None when `PackedLlama` can run `backend`'s model; otherwise why not."""
    torch = backend._torch
    if backend.device != "cpu":
        return f"device {backend.device} (packing is for cpu)"
    if backend.dtype != "float32":
        return f"dtype {backend.dtype} (packing is for float32)"
    ops = getattr(torch.ops, "mkldnn", None)
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    ):
        return f"torch {torch.__version__} has no oneDNN prepacked linear"
    return None


def choose_forward(backend: Any, sequence: type, wanted: str) -> LeanLlama | None:
    """The forward `backend` runs for `wanted`, one of FORWARDS (`TorchBackend` refuses any
    other before the model loads): None for the transformers one. "auto" takes the first of
    packed, lean that holds (`checked_forward`), else None; a named one that does not hold is
    refused with InvalidOverrideError saying why."""
    from muser.errors import InvalidOverrideError

    if wanted == "transformers":
        return None
    reasons = []
    for kind in ("packed", "lean") if wanted == "auto" else (wanted,):
        if wanted == "auto" and kind == "packed" and _largest(backend._model) < PACK_MIN_ELEMENTS:
            continue  # a tiny model: the lean forward is the faster
        engine, why = checked_forward(backend, sequence, kind)
        if engine is not None:
            return engine
        reasons.append(f"{kind}: {why}")
    if wanted == "auto":
        return None
    raise InvalidOverrideError(
        f"forward {wanted!r} refused for {type(backend._model).__name__} ({'; '.join(reasons)}): "
        'forward "auto" takes the fastest forward that holds for this model'
    )


def _largest(model: Any) -> int:
    """Elements of the model's largest matrix (a projection, or the embedding = tied head)."""
    return max((p.numel() for p in model.parameters() if p.dim() == 2), default=0)


def checked_forward(backend: Any, sequence: type, kind: str) -> tuple[LeanLlama | None, str]:
    """A `LeanLlama` ("lean") or `PackedLlama` ("packed") for the `TorchBackend` `backend`
    when it reproduces the backend's model, else (None, why): supported, and its rows equal
    the transformers forward's (bit for bit; the packed one within PACKED_TOLERANCE) on both
    of the backend's paths, one KV (a prefill, one token, three more) and two `sequence`s in a
    batch (ragged prefills, ragged chunks, one query each): every branch transformers'
    attention takes for these calls; on the batched path the outputs of the layers it keeps
    (capture) agree too. The packed forward's rows must also not depend on the path: the
    first batched sequence's rows are the one-KV rows of the same tokens, bit for bit."""
    why = supports(backend._model)
    if why is None and kind == "packed":
        why = packing_refusal(backend)
    if why is not None:
        return None, why
    torch, model = backend._torch, backend._model
    ids = [(7 * i + 3) % backend.vocab_size for i in range(12)]
    if kind == "lean":

        def agree(x, y) -> bool:
            return x.shape == y.shape and bool((x == y).all())
    else:

        def agree(x, y) -> bool:
            x, y = torch.as_tensor(x), torch.as_tensor(y)
            tol = PACKED_TOLERANCE
            return x.shape == y.shape and torch.allclose(x, y, rtol=tol, atol=tol)

    try:  # another transformers may lack a helper or an attribute read here: not ours then
        engine = LeanLlama(model) if kind == "lean" else PackedLlama(model)
        solo = []
        with torch.inference_mode():
            ours, theirs = backend._new_cache(), backend._new_cache()
            for chunk in (ids[:5], ids[5:6], ids[6:9]):
                x = torch.tensor([chunk], dtype=torch.long, device=backend.device)
                mine = engine.solo_logits(x, ours)
                ref = model(input_ids=x, use_cache=True, **{backend._cache_kwarg: theirs})
                if not agree(mine, ref.logits):
                    return None, "its one-KV rows differ from the transformers forward's"
                solo += list(mine[0, :, : backend.vocab_size].to("cpu", torch.float64).numpy())
        rows, first = [], []  # first: the engine's rows of `a` (ids[:10])
        layers = ([0, len(engine.layers) - 1], [0])  # captured rows too (hooks on theirs)
        for use in (engine, None):
            backend._lean = use
            a, b = sequence(backend), sequence(backend)  # (context_length unchecked)
            steps = ([ids[:5], ids[:2]], [ids[5:9], ids[2:3]], [ids[9:10], ids[3:4]])
            got = []
            for step in steps:
                logits, captured = backend._batch_rows([a, b], step, layers)
                got += [*logits, *(c[i] for c in captured for i in sorted(c))]
                first += list(logits[0]) if use is engine else []
            rows.append(got)
    except (ImportError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
        return None, f"it failed on this model ({type(exc).__name__}: {exc})"
    finally:
        backend._lean = None
    if not all(agree(x, y) for x, y in zip(*rows, strict=True)):
        return None, "its batched rows differ from the transformers forward's"
    if (
        kind == "packed"
        and not all(  # ids[:9], one KV and batched
            x.tobytes() == y.tobytes() for x, y in zip(solo, first[:9], strict=True)
        )
    ):
        return None, "its batched rows are not its one-KV rows bit for bit"
    return engine, ""
