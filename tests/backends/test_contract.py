"""The backend contract (tests/backends/contract.py) against torch, mlx and the windowed
wrapper (window 3 over torch); vllm runs the same class under its marker."""

from __future__ import annotations

import pytest

from tests.backends.contract import BackendContract


class TestContract(BackendContract):
    @pytest.fixture(params=["torch", "mlx", "windowed"])
    def kind(self, request: pytest.FixtureRequest) -> str:
        return request.param
