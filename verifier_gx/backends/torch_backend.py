"""Target (and draft) backend on PyTorch + transformers, with a real KV cache.

Implements `muser.backend.ModelBackend`. One `DynamicCache` holds the KV of one sequence;
`evaluate` appends, `rollback` crops. The cache is built without the model config, so every
layer keeps full-length KV and can be cropped to any length; sliding-window models still
attend within their window because transformers builds the mask from the config.

Many sequences (`muser.backend.MultiSequenceBackend`, the verifier's sessions): `sequence()`
gives a `TorchSequence` with its own KV buffers (per layer, grown by doubling), and
`evaluate_batch` runs several sequences' new tokens in one forward. The ragged batch is
right-padded: row i holds sequence i's new tokens at positions length_i.., attention reads
each sequence's own KV (padded to the longest) through an additive 4D mask that lets query j
of row i see keys [0, length_i + j] of row i only; padded queries and keys are masked. Rows
match the one-sequence forward within float rounding (tested to 1e-4 in log-prob). The
batched path needs full attention through a mask the model takes as given (sdpa or eager,
no sliding window) and is checked once against a cache-free forward; a model that fails the
check keeps the one-KV path (`can_batch` False).

The forward: where `llama_forward.LeanLlama` reproduces the model (Llama checkpoints under
sdpa), the backend runs it instead of the transformers module tree, on the same weights, and
only after `llama_forward.lean_forward` found its rows bit-equal to the transformers
forward's on this very model, on both paths (one KV, ragged batch). The rows are the same; a
forward of the project's small models costs a third less. `lean=False` keeps the
transformers forward; `forward_kind` says which one runs. Captured hidden rows always come
from the transformers forward (its hooks).

Overrides take effect in the model itself: `rope_theta` is written into the config the
model is built from (the rotary tables are computed from it at init), and `context_length`
moves the point where `evaluate` refuses with ContextOverflowError.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Sequence
from typing import Literal

import numpy as np

from muser.backend import Geometry, ModelIdentity
from muser.errors import CaptureLayerError, InvalidOverrideError, ModelLoadError
from muser.geometry import check_rollback, check_room, check_tokens, read_geometry
from muser.identity import model_identity

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[Dtype, ...] = ("float32", "bfloat16", "float16")


def _set_rope_theta(config, theta: float) -> None:
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


class _BatchKv:
    """The KV of the sequences in one forward, in the shape the model's attention calls.

    `update` writes each row's new keys/values into its sequence's own buffers (after the
    sequence's committed length) and returns every row's keys/values [0, length + new),
    right-padded with zeros to the longest: the mask hides the padding. One sequence reads
    its buffers in place (no copy), and so do clones that are consecutive rows of one group
    (`TorchSequence.clones`), their padding what their rows hold there. Lengths move only
    once the whole forward succeeded (`TorchSequence._commit`), so a failed forward leaves
    every sequence as it was."""

    def __init__(self, seqs: list[TorchSequence], counts: list[int]) -> None:
        self.seqs, self.counts = seqs, counts
        self.total = max(s.length + n for s, n in zip(seqs, counts, strict=True))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        rows = []
        for i, (seq, n) in enumerate(zip(self.seqs, self.counts, strict=True)):
            rows.append(seq._write(layer_idx, key_states[i, :, :n], value_states[i, :, :n]))
        if len(rows) == 1:
            k, v = rows[0]
            return k.unsqueeze(0), v.unsqueeze(0)
        group = self._group()
        if group is not None:  # the rows of one tensor, in order: read in place
            keys, values, first = group
            rows_of = slice(first, first + len(rows))
            keys, values = keys[layer_idx][rows_of], values[layer_idx][rows_of]
            return keys[:, :, : self.total], values[:, :, : self.total]
        b, h, _, d = key_states.shape
        keys = key_states.new_zeros((b, h, self.total, d))
        values = value_states.new_zeros((b, h, self.total, d))
        for i, (k, v) in enumerate(rows):
            keys[i, :, : k.shape[1]] = k
            values[i, :, : v.shape[1]] = v
        return keys, values

    def _group(self) -> tuple | None:
        """(keys, values, first row) when the sequences are consecutive rows of one group
        (`TorchSequence.clones`), in order, each still on its row's buffers; else None."""
        first = self.seqs[0]._row
        if first is None:
            return None
        group, row = first
        for i, seq in enumerate(self.seqs):
            if seq._row is None or seq._row[0] is not group or seq._row[1] != row + i:
                return None
        return group[0], group[1], row


class TorchSequence:
    """One sequence's KV over a `TorchBackend`'s weights (`ModelBackend`; made by
    `TorchBackend.sequence()`). Dropping it frees its KV."""

    def __init__(self, owner: TorchBackend) -> None:
        self.owner = owner
        self.identity, self.geometry = owner.identity, owner.geometry
        self._tokens: list[int] = []
        self._keys: list = []
        self._values: list = []
        self._row: tuple | None = None
        """(group, row) while this sequence's buffers are row `row` of a group's tensors
        (`clones`); None once it has buffers of its own."""

    @property
    def vocab_size(self) -> int:
        return self.owner.vocab_size

    @property
    def length(self) -> int:
        return len(self._tokens)

    @property
    def num_layers(self) -> int:
        return self.owner.num_layers

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; float64 logits (len(tokens), vocab_size)."""
        return self.owner.evaluate_batch([(self, tokens)])[0]

    def evaluate_capture(
        self, tokens: Sequence[int], layers: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`TorchBackend.evaluate_capture` on this sequence."""
        wanted = self.owner._check_layers(layers)
        rows, captured = self.owner._forward_batch([(self, tokens)], wanted)
        return rows[0], captured

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens (refuses n < 0 or n > length); the buffers are kept."""
        check_rollback(n, self.length)
        if n:
            del self._tokens[-n:]

    def reset(self) -> None:
        """Drop the whole KV, buffers included."""
        self._tokens.clear()
        self._keys, self._values = [], []
        self._row = None

    def clones(self, n: int) -> list[TorchSequence]:
        """`n` clones (`clone`) whose buffers are the rows of one tensor per layer, keys and
        values: a forward over all of them, in this order, reads their KV in place instead of
        copying it into a padded batch (the proposer drafts its guesses on such clones).
        Beyond each clone's length its row holds zeros or keys it rolled back: the mask
        hides them, as it hides the padding of a copied batch."""
        if n < 1:
            raise ValueError(f"clones({n!r}): expected n >= 1")
        twins = [TorchSequence(self.owner) for _ in range(n)]
        group: tuple[list, list] = ([], [])
        for buffers, mine in zip(group, (self._keys, self._values), strict=True):
            for buf in mine:
                rows = buf.new_zeros((n, *buf.shape))
                rows[:, :, : self.length] = buf[:, : self.length]
                buffers.append(rows)
        for i, twin in enumerate(twins):
            twin._tokens = list(self._tokens)
            twin._keys = [rows[i] for rows in group[0]]
            twin._values = [rows[i] for rows in group[1]]
            twin._row = (group, i) if self._keys else None
        return twins

    def leave_group(self) -> None:
        """Copy this clone's row out of its group (`clones`) into buffers of its own, so the
        group's tensors are freed once its other clones are dropped (the proposer keeps the
        clone whose guess held); nothing for a sequence that has buffers of its own."""
        if self._row is not None:
            self._keys = [k.clone() for k in self._keys]
            self._values = [v.clone() for v in self._values]
            self._row = None

    def clone(self) -> TorchSequence:
        """A new sequence of the same backend holding a copy of this one's KV: the two then
        grow and roll back independently (the proposer drafts several guesses at once on
        clones of one session's draft KV)."""
        twin = TorchSequence(self.owner)
        twin._tokens = list(self._tokens)
        twin._keys = [k.clone() for k in self._keys]  # whole buffers: room to grow as before
        twin._values = [v.clone() for v in self._values]
        return twin

    def _write(self, layer: int, k, v):
        """Store new keys/values (heads, n, dim) after `length`; return [0, length + n)."""
        start, end = self.length, self.length + k.shape[1]
        if layer == len(self._keys):
            self._row = None  # buffers of its own from here on
            cap = max(64, 1 << (end - 1).bit_length())
            shape = (k.shape[0], cap, k.shape[2])
            self._keys.append(k.new_empty(shape))
            self._values.append(v.new_empty(shape))
        buf_k, buf_v = self._keys[layer], self._values[layer]
        if end > buf_k.shape[1]:
            cap = 1 << (end - 1).bit_length()
            grown_k = buf_k.new_empty((buf_k.shape[0], cap, buf_k.shape[2]))
            grown_v = buf_v.new_empty(grown_k.shape)
            grown_k[:, :start] = buf_k[:, :start]
            grown_v[:, :start] = buf_v[:, :start]
            self._keys[layer], self._values[layer] = buf_k, buf_v = grown_k, grown_v
            self._row = None  # off its group's row
        buf_k[:, start:end] = k
        buf_v[:, start:end] = v
        return buf_k[:, :end], buf_v[:, :end]

    def _commit(self, ids: list[int]) -> None:
        self._tokens.extend(ids)


class TorchBackend:
    """A causal LM under torch with the KV cache of one sequence (`ModelBackend`), and
    per-sequence KV with batched forwards for the verifier (`MultiSequenceBackend`)."""

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
        lean: bool = True,
    ) -> None:
        import torch

        if dtype not in DTYPES:
            raise InvalidOverrideError(f"dtype {dtype!r} is not one of {DTYPES}")
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise InvalidOverrideError(f"threads {threads!r} is invalid: expected int ≥ 1")
            torch.set_num_threads(threads)  # process-wide; tiny models run faster on one
        if not isinstance(lean, bool):
            raise InvalidOverrideError(f"lean {lean!r} is invalid: expected true or false")
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
        self._lean = None
        if lean:
            from verifier_gx.backends.llama_forward import lean_forward

            self._lean = lean_forward(self, TorchSequence)

    def _load(self, path, rope_theta: float | None, torch_dtype):
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(path)
            if rope_theta is not None:
                _set_rope_theta(config, float(rope_theta))
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype)
            model.to(self.device)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{path}: transformers could not load the checkpoint ({exc})"
            ) from exc
        return model.eval()

    @property
    def forward_kind(self) -> str:
        """Which forward computes the rows: "lean" or "transformers" (module note)."""
        return "lean" if self._lean is not None else "transformers"

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    @property
    def device_label(self) -> str:
        """Where the rows are computed, as `muser status` reports it: "torch:cuda:0"…"""
        return f"torch:{self.device}"

    @property
    def vocab_size(self) -> int:
        return self.identity.vocab_size

    @property
    def length(self) -> int:
        return len(self._tokens)

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

    def _forward_batch(
        self, work: Sequence[tuple[TorchSequence, Sequence[int]]], layers: Sequence[int]
    ) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        seqs = [seq for seq, _ in work]
        for seq in seqs:
            if not isinstance(seq, TorchSequence) or seq.owner is not self:
                raise TypeError(f"{seq!r} is not a sequence of this backend")
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        ids = [check_tokens(tokens, self.vocab_size) for _, tokens in work]
        for seq, new in zip(seqs, ids, strict=True):
            check_room(seq.length, len(new), self.geometry.context_length)
        return self._batch_rows(seqs, ids, layers)

    def _batch_rows(
        self, seqs: list[TorchSequence], ids: list[list[int]], layers: Sequence[int]
    ) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """`_forward_batch` on checked input."""
        out = [np.zeros((0, self.vocab_size)) for _ in ids]
        live = [i for i, new in enumerate(ids) if new]
        if not live:
            return out, {}
        if layers and len(live) > 1:
            raise ValueError("hidden rows are captured one sequence at a time")
        torch = self._torch
        seqs, ids = [seqs[i] for i in live], [ids[i] for i in live]
        counts = [len(x) for x in ids]
        cache = _BatchKv(seqs, counts)
        rows, positions, mask = self._inputs(seqs, ids, counts, cache.total)
        captured: dict[int, np.ndarray] = {}
        hooks = [self._hook(i, captured) for i in layers]
        try:
            with torch.inference_mode():
                input_ids, position_ids = rows.to(self.device), positions.to(self.device)
                mask = mask[:, None].to(self.device)
                if self._lean is not None and not layers:
                    logits = self._lean.logits(input_ids, position_ids, mask, cache)
                else:
                    logits = self._model(
                        input_ids=input_ids,
                        attention_mask=mask,
                        position_ids=position_ids,
                        use_cache=True,
                        **{self._cache_kwarg: cache},
                    ).logits
        finally:
            for hook in hooks:
                hook.remove()
        logits = logits[:, :, : self.vocab_size].to("cpu", torch.float64).numpy()
        for seq, x in zip(seqs, ids, strict=True):
            seq._commit(x)
        for j, i in enumerate(live):
            out[i] = logits[j, : counts[j]]
        for layer in captured:
            captured[layer] = captured[layer][: counts[0]]
        return out, captured

    def _inputs(self, seqs: list[TorchSequence], ids: list[list[int]], counts: list[int],
                total: int):  # fmt: skip
        """The token rows (B, W), positions (B, W) and additive mask (B, W, total) of a batch:
        query j of row i sees keys [0, length_i + j] (mask 0, else the dtype's lowest);
        padded queries repeat the last real one. Built in numpy (a few microseconds an
        operation on arrays this small, where each torch call costs several times that); one
        token of one sequence, a draft step, takes three torch calls to the same tensors."""
        torch = self._torch
        if counts == [1]:  # one query: it sees every key
            return (
                torch.tensor(ids, dtype=torch.int64),
                torch.tensor([[seqs[0].length]], dtype=torch.int64),
                torch.zeros((1, 1, total), dtype=self._mask_dtype),
            )
        return self._ragged_inputs(seqs, ids, counts, total)

    def _ragged_inputs(self, seqs: list[TorchSequence], ids: list[list[int]],
                       counts: list[int], total: int):  # fmt: skip
        """`_inputs` for any batch."""
        torch = self._torch
        width = max(counts)
        rows = np.zeros((len(ids), width), dtype=np.int64)
        for i, x in enumerate(ids):
            rows[i, : len(x)] = x
        lengths = np.array([s.length for s in seqs], dtype=np.int64)[:, None]
        steps = np.arange(width)[None, :]
        positions = lengths + steps
        last = lengths + np.minimum(steps, np.array(counts)[:, None] - 1)
        visible = np.arange(total)[None, None, :] <= last[:, :, None]
        mask = np.where(visible, np.float32(0), self._mask_lowest)
        mask = torch.from_numpy(mask).to(self._mask_dtype)
        return torch.from_numpy(rows), torch.from_numpy(positions), mask

    def _decoder_layers(self):
        base = getattr(self._model, self._model.base_model_prefix, self._model)
        layers = getattr(base, "layers", None)
        if layers is None:
            raise ModelLoadError(f"{type(self._model).__name__}: no decoder `layers` to capture")
        return layers

    def _forward(
        self, tokens: Sequence[int], layers: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        ids = check_tokens(tokens, self.vocab_size)
        check_room(self.length, len(ids), self.geometry.context_length)
        if not ids:
            empty = np.zeros((0, self.geometry.hidden_size), np.float32)
            return np.zeros((0, self.vocab_size)), {i: empty.copy() for i in layers}
        torch = self._torch
        captured: dict[int, np.ndarray] = {}
        hooks = [self._hook(i, captured) for i in layers]
        try:
            with torch.inference_mode():
                input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
                if self._lean is not None and not layers:
                    logits = self._lean.solo_logits(input_ids, self._cache)
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
        return logits, captured

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

    def _hook(self, index: int, captured: dict[int, np.ndarray]):
        torch = self._torch

        def keep(_module, _args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            captured[index] = hidden[0].to("cpu", torch.float32).numpy()

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
