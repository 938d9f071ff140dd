"""The proposer tests reuse the verifier tests' key set (keys on disk, one per role)."""

from tests.verifier.conftest import key_set  # noqa: F401  (a fixture, re-exported)
