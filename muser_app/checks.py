"""The backends' own checks for the config rules (`cluster_config.rules.BackendChecks`):
config imports no daemon, so the application, which sits above both, hands them in."""

from __future__ import annotations

from cluster_config.rules import BackendChecks


def _draft_device(device: str) -> object:
    from proposer_mac.backends.mlx_draft import choose_device  # ImportError without mlx

    return choose_device(device)


def backend_checks() -> BackendChecks:
    """Both daemons' checks: target capture kinds and devices, the mlx draft's device."""
    from muser_torch.backend import check_device
    from verifier_gx.backends import CAPTURE_KINDS

    return BackendChecks(
        capture_kinds=CAPTURE_KINDS, target_device=check_device, draft_device=_draft_device
    )


def check_config(config, role=None, *, receipt: bool = True) -> None:
    """`cluster_config.rules.check_rules` with both daemons' backend checks."""
    from cluster_config.rules import check_rules

    check_rules(config, role, backends=backend_checks(), receipt=receipt)
