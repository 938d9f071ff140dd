"""Draft backend on PyTorch: the torch model runner the target uses too (docs/design.md §9).

Both sides share one implementation (`muser_torch`) so the torch draft and the torch target
cannot drift; this module exists so the proposer names its backends in one place.
"""

from __future__ import annotations

from muser_torch.backend import DTYPES, Dtype, TorchBackend


class TorchDraftBackend(TorchBackend):
    """`TorchBackend` as a draft: same contract, same cache, same overrides."""


__all__ = ["DTYPES", "Dtype", "TorchDraftBackend"]
