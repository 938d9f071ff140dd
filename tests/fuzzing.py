"""What the gRPC fuzzers share (tests/verifier/test_wire_fuzz.py,
tests/proposer/test_generate_fuzz.py): hypothesis settings for N cases, and a watch on the
log for exceptions no handler answered."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from hypothesis import HealthCheck, settings


def cases(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@contextlib.contextmanager
def unhandled_errors() -> Iterator[list[logging.LogRecord]]:
    """The ERROR records logged inside (gRPC logs a servicer's unhandled exception there)."""
    errors: list[logging.LogRecord] = []
    catch = logging.Handler(logging.ERROR)
    catch.emit = errors.append
    logging.getLogger().addHandler(catch)
    try:
        yield errors
    finally:
        logging.getLogger().removeHandler(catch)
