"""Helpers shared by the backend tests (a plain module: conftest names can collide)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PROMPT = [17, 3, 250, 88, 41, 199, 5, 64, 120, 9, 300, 77, 2, 150, 33, 260]


# vLLM's CPU attention has no kernel for the default tiny head size (64 / 4 heads = 16).
CHECKPOINT_OPTIONS: dict[str, dict[str, object]] = {"vllm": {"hidden_size": 128}}


def checkpoint_options(kind: str) -> dict[str, object]:
    """The tiny-checkpoint options a backend kind needs (none for most)."""
    return dict(CHECKPOINT_OPTIONS.get(kind, {}))


def build_backend(kind: str, path: Path, **opts: object):
    """kind ∈ torch | mlx | windowed (torch inner, window from opts, default 3) | vllm."""
    if kind == "vllm":
        from verifier_gx.backends.vllm_backend import VllmBackend

        return VllmBackend(path, **opts)
    if kind == "torch":
        from muser_torch.backend import TorchBackend

        return TorchBackend(path, **opts)
    if kind == "mlx":
        from proposer_mac.backends.mlx_draft import MlxBackend

        return MlxBackend(path, device="cpu", **opts)
    if kind == "windowed":
        from muser_torch.backend import TorchBackend
        from proposer_mac.backends.windowed import WindowedBackend

        window = opts.pop("window", 3)
        return WindowedBackend(TorchBackend(path, **opts), window)
    raise ValueError(kind)


def float64_rows(path: Path, tokens: list[int], window: int | None = None, **config) -> np.ndarray:
    """The slow reference: the torch model in float64, whole sequence, no cache.

    With `window`, row i is recomputed from the `window` tokens ending at token i alone.
    `config` entries are set on the model config before loading (e.g. rope overrides).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float64).eval()
    with torch.no_grad():
        if window is None:
            return model(torch.tensor([tokens])).logits[0].numpy()
        rows = [
            model(torch.tensor([tokens[max(0, i + 1 - window) : i + 1]])).logits[0, -1].numpy()
            for i in range(len(tokens))
        ]
    return np.stack(rows)
