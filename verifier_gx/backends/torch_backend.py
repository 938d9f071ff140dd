"""Target (and draft) backend on PyTorch + transformers, with a real KV cache.

Implements `muser.backend.ModelBackend`. One `DynamicCache` holds the KV of one sequence;
`evaluate` appends, `rollback` crops. The cache is built without the model config, so every
layer keeps full-length KV and can be cropped to any length; sliding-window models still
attend within their window because transformers builds the mask from the config.

Overrides take effect in the model itself: `rope_theta` is written into the config the
model is built from (the rotary tables are computed from it at init), and `context_length`
moves the point where `evaluate` refuses with ContextOverflowError.
"""

from __future__ import annotations

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


def check_device(device: str) -> str:
    """The torch device `device` names ("cpu", "cuda", "cuda:1"), refused when this machine
    cannot run it, naming the setting to change (`verifier.device` in cluster.toml)."""
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
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise InvalidOverrideError(
            f"device {device!r} requested (verifier.device) but torch {torch.__version__} "
            f'({build}) sees no CUDA device here: set verifier.device = "cpu", or install a '
            "CUDA build of torch on a machine with an NVIDIA GPU"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise InvalidOverrideError(
            f"device {device!r} requested (verifier.device) but torch sees {count} CUDA "
            f"device(s): use cuda:0..cuda:{count - 1}"
        )
    return str(parsed)


class TorchBackend:
    """A causal LM under torch with the KV cache of one sequence (`ModelBackend`)."""

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
    ) -> None:
        import torch

        if dtype not in DTYPES:
            raise InvalidOverrideError(f"dtype {dtype!r} is not one of {DTYPES}")
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise InvalidOverrideError(f"threads {threads!r} is invalid: expected int ≥ 1")
            torch.set_num_threads(threads)  # process-wide; tiny models run faster on one
        self.device = check_device(device)
        self.identity = model_identity(path)
        self.geometry = read_geometry(path, context_length=context_length, rope_theta=rope_theta)
        self.dtype = dtype
        self._torch = torch
        self._model = self._load(path, rope_theta, getattr(torch, dtype))
        # transformers 5.2x renamed `past_key_values` to `cache`; older 5.x only knows the first.
        params = inspect.signature(self._model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._tokens: list[int] = []
        self._cache = self._new_cache()

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
        count = self.num_layers
        wanted = sorted({int(i) for i in layers})
        for i in wanted:
            if not 0 <= i < count:
                raise CaptureLayerError(f"capture layer {i} outside [0, {count}) decoder layers")
        return self._forward(tokens, wanted)

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
                kwargs = {self._cache_kwarg: self._cache}  # the cache is updated in place
                out = self._model(input_ids=input_ids, use_cache=True, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        self._tokens.extend(ids)
        logits = out.logits[0, :, : self.vocab_size].to("cpu", torch.float64).numpy()
        return logits, captured

    def _hook(self, index: int, captured: dict[int, np.ndarray]):
        torch = self._torch

        def keep(_module, _args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            captured[index] = hidden[0].to("cpu", torch.float32).numpy()

        return self._decoder_layers()[index].register_forward_hook(keep)

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
