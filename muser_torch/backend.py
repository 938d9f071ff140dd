"""Target (and draft) backend on PyTorch + transformers, with a real KV cache.

Implements `muser.backend.ModelBackend`. One `DynamicCache` holds the KV of one sequence;
`evaluate` appends, `rollback` crops. The cache is built without the model config, so every
layer keeps full-length KV and can be cropped to any length; sliding-window models still
attend within their window because transformers builds the mask from the config.

Many sequences (`muser.backend.MultiSequenceBackend`, the verifier's sessions; the buffers,
the batch cache and the mask live in `muser_torch.batched`): `sequence()` gives a
`TorchSequence` with its own KV buffers (per layer, grown by doubling), and
`evaluate_batch` runs several sequences' new tokens in one forward. The ragged batch is
right-padded: row i holds sequence i's new tokens at positions length_i.., attention reads
each sequence's own KV (padded to the longest) through an additive 4D mask that lets query j
of row i see keys [0, length_i + j] of row i only; padded queries and keys are masked. Rows
match the one-sequence forward within float rounding (tested to 1e-4 in log-prob). The
batched path needs full attention through a mask the model takes as given (sdpa or eager,
no sliding window) and is checked once against a cache-free forward; a model that fails the
check keeps the one-KV path (`can_batch` False).

The forward (`forward=`, `llama_forward.FORWARDS`): where `llama_forward.LeanLlama`
reproduces the model (Llama checkpoints under sdpa), the backend runs it instead of the
transformers module tree, on the same weights, and only after `llama_forward.checked_forward`
found its rows bit-equal to the transformers forward's on this very model, on both paths
(one KV, ragged batch): "lean", a third cheaper than the module tree on small models. On a
CPU in float32, "packed" (`llama_forward.PackedLlama`) also reorders the projections'
weights once for oneDNN and attends one query at a time, so a few-position verify costs
about one decode instead of two and a position's row is the same bits on every path (decode,
chunk, prefill, batch, tree); its rows are the transformers rows within rounding (checked on
load to PACKED_TOLERANCE), not bit for bit. "auto" (the default) takes packed for models
large enough to gain (PACK_MIN_ELEMENTS), else lean, else the transformers forward; a named
forward that does not hold is refused. `forward_kind` says which one runs. Captured
hidden rows come from the forward that computes the logits (its kept layer outputs, or the
transformers layers' hooks).

Overrides take effect in the model itself: `rope_theta` is written into the config the
model is built from (the rotary tables are computed from it at init), and `context_length`
moves the point where `evaluate` refuses with ContextOverflowError.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from muser.backend import Geometry, HeldTokens, ModelIdentity, mask_undefined
from muser.errors import CaptureLayerError, InvalidOverrideError, ModelLoadError
from muser.geometry import check_rollback, check_room, check_tokens, read_geometry
from muser.identity import model_identity
from muser.tree import tree_depths
from muser_torch.batched import (
    BatchKv,
    TorchSequence,
    batch_inputs,
    mixed_inputs,
)
from muser_torch.llama_forward import FORWARDS, PackedLlama, choose_forward

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[Dtype, ...] = ("float32", "bfloat16", "float16")


def set_rope_theta(config, theta: float) -> None:
    """Write `theta` wherever this transformers config keeps it (v5 nests it)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        nested = [v for v in params.values() if isinstance(v, dict)]
        for p in nested or [params]:
            p["rope_theta"] = theta
    if hasattr(config, "rope_theta") or not isinstance(params, dict):
        config.rope_theta = theta


def check_device(device: str, setting: str = "verifier.device") -> str:
    """The torch device `device` names ("cpu", "cuda", "cuda:1"), refused when this machine
    cannot run it, naming the setting to change (`verifier.device` in cluster.toml, or a
    command's flag)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidOverrideError(
            f"device {device!r} is not a torch device: expected cpu, cuda or cuda:N ({exc})"
        ) from None
    if parsed.type == "cpu":
        return str(parsed)
    if parsed.type != "cuda":
        raise InvalidOverrideError(
            f"device {device!r} refused: the torch backend runs on cpu or cuda[:N]"
        )
    if not torch.cuda.is_available():
        to_cpu = f"pass {setting} cpu" if setting.startswith("--") else f'set {setting} = "cpu"'
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise InvalidOverrideError(
            f"device {device!r} requested ({setting}) but torch {torch.__version__} "
            f"({build}) sees no CUDA device here: {to_cpu}, or install a "
            "CUDA build of torch on a machine with an NVIDIA GPU"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise InvalidOverrideError(
            f"device {device!r} requested ({setting}) but torch sees {count} CUDA "
            f"device(s): use cuda:0..cuda:{count - 1}"
        )
    return str(parsed)


class TorchBackend(HeldTokens):
    """A causal LM under torch with the KV cache of one sequence (`ModelBackend`), and
    per-sequence KV with batched forwards for the verifier (`MultiSequenceBackend`)."""

    label = "torch"
    identity: ModelIdentity
    geometry: Geometry

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: Dtype = "float32",
        threads: int | None = 1,
        context_length: int | None = None,
        rope_theta: float | None = None,
        forward: str = "auto",
    ) -> None:
        import torch

        if dtype not in DTYPES:
            raise InvalidOverrideError(f"dtype {dtype!r} is not one of {DTYPES}")
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise InvalidOverrideError(f"threads {threads!r} is invalid: expected int ≥ 1")
            torch.set_num_threads(threads)  # process-wide; tiny models run faster on one
        if forward not in FORWARDS:
            raise InvalidOverrideError(
                f"forward {forward!r} is invalid: expected one of {', '.join(FORWARDS)}"
            )
        self.device = check_device(device)
        self.identity = model_identity(path)
        self.geometry = read_geometry(path, context_length=context_length, rope_theta=rope_theta)
        self.dtype = dtype
        self._torch = torch
        self._model = self._load(path, rope_theta, getattr(torch, dtype))
        self._mask_dtype = self._model.dtype  # read once: the property walks every parameter
        # the additive mask's value for a hidden key, exact in float32 for every DTYPES
        self._mask_lowest = np.float32(torch.finfo(self._mask_dtype).min)
        # transformers 5.2x renamed `past_key_values` to `cache`; older 5.x only knows the first.
        params = inspect.signature(self._model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._tokens: list[int] = []
        self._cache = self._new_cache()
        self._batch_ok: bool | None = None  # the batched path's one-time check, when first used
        # the LeanLlama (or PackedLlama) that runs, or None: the module tree
        self._lean = choose_forward(self, TorchSequence, forward)

    def _load(self, path, rope_theta: float | None, torch_dtype):
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(path)
            if rope_theta is not None:
                set_rope_theta(config, float(rope_theta))
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype)
            model.to(self.device)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{path}: transformers could not load the checkpoint ({exc})"
            ) from exc
        return model.eval()

    @property
    def forward_kind(self) -> str:
        """Which forward computes the rows: "packed", "lean" or "transformers" (module
        note)."""
        if self._lean is None:
            return "transformers"
        return "packed" if isinstance(self._lean, PackedLlama) else "lean"

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    @property
    def num_layers(self) -> int:
        return len(self._decoder_layers())

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; float64 logits (len(tokens), vocab_size), positions from `length`."""
        logits, _ = self._forward(tokens, ())
        return logits

    def evaluate_capture(
        self, tokens: Sequence[int], layers: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`evaluate`, plus the float32 (n, hidden) output of each requested decoder layer.

        Layer i's output is what decoder layer i hands to layer i+1 (before the final norm),
        read by a forward hook, so capture never changes the logits.
        """
        return self._forward(tokens, self._check_layers(layers))

    def _check_layers(self, layers: Sequence[int]) -> list[int]:
        count = self.num_layers
        wanted = sorted({int(i) for i in layers})
        for i in wanted:
            if not 0 <= i < count:
                raise CaptureLayerError(f"capture layer {i} outside [0, {count}) decoder layers")
        return wanted

    # ---- many sequences -------------------------------------------------------------------

    @property
    def can_batch(self) -> bool:
        """Whether this model takes the batched path: full attention under a given mask,
        checked once against a cache-free forward (module docstring)."""
        if self._batch_ok is None:
            impl = getattr(self._model.config, "_attn_implementation", None)
            self._batch_ok = (
                self.geometry.sliding_window is None
                and impl in ("sdpa", "eager")
                and self._batch_matches_plain()
            )
        return self._batch_ok

    def _batch_matches_plain(self) -> bool:
        """Two ragged sequences through `evaluate_batch` equal a forward without any cache."""
        torch = self._torch
        ids = [(7 * i + 3) % self.vocab_size for i in range(9)]
        a, b = TorchSequence(self), TorchSequence(self)
        try:
            self._forward_batch([(a, ids[:5]), (b, ids[:2])], ())
            rows, _ = self._forward_batch([(a, ids[5:]), (b, ids[2:4])], ())
            with torch.inference_mode():
                plain = self._model(input_ids=torch.tensor([ids], device=self.device)).logits
        except (TypeError, ValueError, RuntimeError, AttributeError):
            return False
        plain = plain[0, :, : self.vocab_size].to("cpu", torch.float64).numpy()
        tol = 1e-3 if self.dtype == "float32" else 5e-2
        return bool(
            np.abs(rows[0] - plain[5:]).max() < tol and np.abs(rows[1] - plain[2:4]).max() < tol
        )

    def sequence(self) -> TorchSequence:
        """A new sequence with its own empty KV over these weights (refused when the model
        cannot take the batched path: see `can_batch`)."""
        if not self.can_batch:
            raise ModelLoadError(
                f"{self.identity.architecture}: this model keeps one KV (sliding window or an "
                "attention that ignores a given mask); serve sessions on the shared KV"
            )
        return TorchSequence(self)

    def evaluate_batch(
        self, work: Sequence[tuple[TorchSequence, Sequence[int]]]
    ) -> list[np.ndarray]:
        """Append each `tokens` to its sequence in one forward; float64 rows per sequence."""
        return self._forward_batch(work, ())[0]

    def evaluate_batch_capture(
        self, work: Sequence[tuple[TorchSequence, Sequence[int], Sequence[int]]]
    ) -> list[tuple[np.ndarray, dict[int, np.ndarray]]]:
        """`evaluate_batch` of `(seq, tokens, layers)`, plus each sequence's float32 (n,
        hidden) output of its own `layers` (`evaluate_capture`'s rows), in one forward: the
        verifier batches capturing sessions' rounds with the others'."""
        wanted = [self._check_layers(layers) for _, _, layers in work]
        rows, captured = self._forward_batch([(seq, tokens) for seq, tokens, _ in work], wanted)
        return list(zip(rows, captured, strict=True))

    def _forward_batch(
        self,
        work: Sequence[tuple[TorchSequence, Sequence[int]]],
        layers: Sequence[Sequence[int]] | None,
    ) -> tuple[list[np.ndarray], list[dict[int, np.ndarray]]]:
        """Rows of each `(seq, tokens)`, and each one's captured `layers[i]` (None: none)."""
        seqs = [seq for seq, _ in work]
        for seq in seqs:
            if not isinstance(seq, TorchSequence) or seq.owner is not self:
                raise TypeError(f"{seq!r} is not a sequence of this backend")
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        ids = [check_tokens(tokens, self.vocab_size, self.unknown_id) for _, tokens in work]
        for seq, new in zip(seqs, ids, strict=True):
            check_room(seq.length, len(new), self.geometry.context_length)
        return self._batch_rows(seqs, ids, layers or [()] * len(seqs))

    def _batch_rows(
        self, seqs: list[TorchSequence], ids: list[list[int]], layers: Sequence[Sequence[int]]
    ) -> tuple[list[np.ndarray], list[dict[int, np.ndarray]]]:
        """`_forward_batch` on checked input (`layers`: checked, one list per sequence)."""
        out = [np.zeros((0, self.vocab_size)) for _ in ids]
        kept: list[dict[int, np.ndarray]] = [{} for _ in ids]
        live = [i for i, new in enumerate(ids) if new]
        if not live:
            return out, [{i: self._no_rows() for i in wanted} for wanted in layers]
        wanted = sorted({i for j in live for i in layers[j]})
        seqs, ids = [seqs[i] for i in live], [ids[i] for i in live]
        counts = [len(x) for x in ids]
        cache = BatchKv(seqs, counts)
        rows, positions, mask = self._inputs(seqs, ids, counts, cache.total)
        logits, hidden = self._capturing(rows, positions, mask, cache, wanted)
        for seq, x in zip(seqs, ids, strict=True):
            seq._commit(x)
        for j, i in enumerate(live):
            out[i] = logits[j, : counts[j]]
            kept[i] = {layer: hidden[layer][j, : counts[j]] for layer in layers[i]}
        return out, kept

    def _no_rows(self) -> np.ndarray:
        return np.zeros((0, self.geometry.hidden_size), np.float32)

    def evaluate_tree(
        self, seq: TorchSequence, tokens: Sequence[int], parents: Sequence[int]
    ) -> np.ndarray:
        """A token tree after `seq`'s KV in one forward (docs/design.md §3): `tokens[0]` is the
        root (the frontier), `tokens[i + 1]` node i, whose parent is `parents[i]` (-1: the
        root; else an earlier node). Each row sees the committed KV and its own ancestors in
        the block, at position length + its depth (`muser_torch.batched.mixed_inputs`), so
        it is the row a linear forward of its path would give, within float rounding.
        Returns float64 logits (len(tokens), vocab); the block's KV is held after `seq`'s
        length until `seq.keep_path` keeps the accepted path (nothing else reads it)."""
        return self.evaluate_mixed([(seq, tokens, parents)])[0]

    def evaluate_tree_capture(
        self, seq: TorchSequence, tokens: Sequence[int], parents: Sequence[int],
        layers: Sequence[int],
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:  # fmt: skip
        """`evaluate_tree`, plus the float32 (len(tokens), hidden) output of each of `layers`
        at every block entry (`evaluate_capture`'s rows): a capturing session's tree round,
        whose committed rows are the root's and the accepted path's."""
        return self.evaluate_mixed_capture([(seq, tokens, parents, layers)])[0]

    def evaluate_mixed(
        self, work: Sequence[tuple[TorchSequence, Sequence[int], Sequence[int] | None]]
    ) -> list[np.ndarray]:
        """Chains and token trees of several sequences in one forward: each `(seq, tokens,
        parents)` is a chain appended to `seq` (parents None, as `evaluate_batch`) or a tree
        after it (`tokens[0]` the root, as `evaluate_tree`: its block held until
        `seq.keep_path`). The verifier batches tree rounds with other sessions' chains so.
        Float64 logits per sequence; a failed forward leaves every sequence as it was."""
        return [rows for rows, _ in self.evaluate_mixed_capture([(*w, ()) for w in work])]

    def evaluate_mixed_capture(
        self,
        work: Sequence[tuple[TorchSequence, Sequence[int], Sequence[int] | None, Sequence[int]]],
    ) -> list[tuple[np.ndarray, dict[int, np.ndarray]]]:
        """`evaluate_mixed` of `(seq, tokens, parents, layers)`, plus each entry's float32
        (len(tokens), hidden) output of its own `layers` (a tree's at every block entry):
        capturing sessions' chains and trees in the same forward as the others'."""
        seqs = [w[0] for w in work]
        for seq in seqs:
            if not isinstance(seq, TorchSequence) or seq.owner is not self:
                raise TypeError(f"{seq!r} is not a sequence of this backend")
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        ids = [check_tokens(w[1], self.vocab_size, self.unknown_id) for w in work]
        if any(not x for x in ids):
            raise ValueError("every sequence of a mixed batch evaluates at least one token")
        parents = [w[2] for w in work]
        layers = [self._check_layers(w[3]) for w in work]
        depths = [
            None if p is None else tree_depths(p, len(x)) for x, p in zip(ids, parents, strict=True)
        ]
        for seq, x, d in zip(seqs, ids, depths, strict=True):
            check_room(
                seq.length, len(x) if d is None else max(d) + 1, self.geometry.context_length
            )
        cache = BatchKv(seqs, [len(x) for x in ids])
        rows, positions, mask = mixed_inputs(
            self._torch, seqs, ids, parents, depths, cache.total, self._mask_dtype,
            self._mask_lowest,
        )  # fmt: skip
        wanted = sorted({i for w in layers for i in w})
        logits, hidden = self._capturing(rows, positions, mask, cache, wanted)
        for seq, x, p in zip(seqs, ids, parents, strict=True):
            if p is None:
                seq._commit(x)
            else:
                seq._hold_block(x)
        return [
            (logits[j, : len(x)], {i: hidden[i][j, : len(x)] for i in layers[j]})
            for j, x in enumerate(ids)
        ]

    def _capturing(self, rows, positions, mask, cache: BatchKv, wanted: Sequence[int]):
        """`_logits`, as float64 numpy (B, W, vocab), and the float32 (B, W, hidden) output
        of each decoder layer in `wanted`: the lean forward keeps them itself, the
        transformers one through hooks."""
        torch = self._torch
        captured: dict[int, Any] = dict.fromkeys(wanted)
        if self._lean is not None:
            logits = self._logits(rows, positions, mask, cache, keep=captured)
        else:
            hooks = [self._hook(i, captured) for i in wanted]
            try:
                logits = self._logits(rows, positions, mask, cache)
            finally:
                for hook in hooks:
                    hook.remove()
        logits = logits[:, :, : self.vocab_size].to("cpu", torch.float64).numpy()
        mask_undefined(logits, self.defined_vocab)
        return logits, {i: h.to("cpu", torch.float32).numpy() for i, h in captured.items()}

    def _logits(self, rows, positions, mask, cache: BatchKv, keep: dict | None = None):
        """One forward of token `rows` at `positions` under the additive `mask` (B, W, T),
        through `cache`: the lean forward where it runs (which fills `keep` with the
        outputs of the layers it names), else the transformers one (hooks capture)."""
        torch = self._torch
        with torch.inference_mode():
            input_ids, position_ids = rows.to(self.device), positions.to(self.device)
            mask = mask[:, None].to(self.device)
            if self._lean is not None:
                return self._lean.logits(input_ids, position_ids, mask, cache, keep)
            return self._model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                **{self._cache_kwarg: cache},
            ).logits

    def _inputs(self, seqs: list[TorchSequence], ids: list[list[int]], counts: list[int],
                total: int):  # fmt: skip
        """A batch's token rows, positions and mask (`muser_torch.batched.batch_inputs`)."""
        return batch_inputs(
            self._torch, seqs, ids, counts, total, self._mask_dtype, self._mask_lowest
        )

    def _decoder_layers(self):
        base = getattr(self._model, self._model.base_model_prefix, self._model)
        layers = getattr(base, "layers", None)
        if layers is None:
            raise ModelLoadError(f"{type(self._model).__name__}: no decoder `layers` to capture")
        return layers

    def _forward(
        self, tokens: Sequence[int], layers: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        ids = check_tokens(tokens, self.vocab_size, self.unknown_id)
        check_room(self.length, len(ids), self.geometry.context_length)
        if not ids:
            return np.zeros((0, self.vocab_size)), {i: self._no_rows() for i in layers}
        torch = self._torch
        captured: dict[int, Any] = dict.fromkeys(layers)
        hooks = [] if self._lean is not None else [self._hook(i, captured) for i in layers]
        try:
            with torch.inference_mode():
                input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
                if self._lean is not None:
                    logits = self._lean.solo_logits(input_ids, self._cache, captured)
                else:
                    kwargs = {self._cache_kwarg: self._cache}  # the cache is updated in place
                    logits = self._model(input_ids=input_ids, use_cache=True, **kwargs).logits
        except BaseException:
            self._cut_to_tokens()
            raise
        finally:
            for hook in hooks:
                hook.remove()
        self._tokens.extend(ids)
        logits = logits[0, :, : self.vocab_size].to("cpu", torch.float64).numpy()
        mask_undefined(logits, self.defined_vocab)
        return logits, {i: h[0].to("cpu", torch.float32).numpy() for i, h in captured.items()}

    def _cut_to_tokens(self) -> None:
        """After a forward that failed part-way (out of memory at layer k): the layers it
        reached hold its tokens' KV and the others do not, while `length` says neither. Every
        layer is cut back to the tokens this backend holds, so the next forward attends to
        exactly those (or, for a cache without layers to cut, the cache is rebuilt)."""
        held = len(self._tokens)
        layers = getattr(self._cache, "layers", None)
        if layers is None:
            tokens = list(self._tokens)
            self.reset()
            if tokens:
                self._forward(tokens, ())
            return
        for layer in layers:
            if getattr(layer, "is_initialized", False):
                extra = layer.keys.shape[-2] - held
                if extra > 0:
                    layer.crop(-extra)

    def _hook(self, index: int, captured: dict[int, Any]):
        def keep(_module, _args, output) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output

        return self._decoder_layers()[index].register_forward_hook(keep)

    def fork(self) -> TorchBackend:
        """An empty sequence over the same weights, through this very forward (rows
        bit-equal to this backend's for the same tokens): the proposer gives each session its
        own draft KV with it, so sessions never re-prefill each other's."""
        twin = copy.copy(self)
        twin._cache, twin._tokens = self._new_cache(), []
        return twin

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens of KV (a crop; refuses n < 0 or n > length)."""
        check_rollback(n, self.length)
        if n == 0:
            return
        self._cache.crop(-n)  # transformers 5: a negative count removes that many tokens
        del self._tokens[-n:]

    def reset(self) -> None:
        """Drop the whole cache."""
        self._cache = self._new_cache()
        self._tokens.clear()
