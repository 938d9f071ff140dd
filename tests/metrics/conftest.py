"""Fixtures shared with the verifier and cluster suites: an in-process verifier on the fake
backend, and the cached fixture pair for real subprocess daemons."""

from tests.cluster.conftest import fixture_pair  # noqa: F401
from tests.verifier.conftest import key_set, verifier  # noqa: F401
