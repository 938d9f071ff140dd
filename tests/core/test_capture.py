"""Capture fragments (muser/capture.py): float16 on the wire, and every way a result's rows
can fail to be the ones it names is refused before a row is read."""

from __future__ import annotations

import numpy as np
import pytest

from muser.canonical import CanonicalError, Writer
from muser.capture import decode_capture, encode_capture, result_rows
from muser.errors import RefusedError

SID, OTHER = b"s" * 16, b"o" * 16


def rows(n: int, layer: int, first: int = 0) -> np.ndarray:
    return np.array([[layer, first + i, 0.5 + i] for i in range(n)], dtype=np.float32)


def fragments(layers=(2, 5), first=3, n=4, round_=7, sid=SID):
    made = [encode_capture(sid, round_, layer, first, rows(n, layer, first)) for layer in layers]
    return [d for d, _ in made], dict(made)


def test_rows_round_trip_through_float16_at_half_the_bytes() -> None:
    values = np.random.default_rng(0).normal(size=(5, 64)).astype(np.float32)
    digest, data = encode_capture(SID, 3, 14, 100, values)
    got = decode_capture(data)
    assert (got.session_id, got.round, got.layer, got.first) == (SID, 3, 14, 100)
    np.testing.assert_array_equal(got.rows, values.astype(np.float16).astype(np.float32))
    assert 5 * 64 * 2 <= len(data) < 5 * 64 * 2 + 128


def test_a_result_hands_back_each_layers_rows_from_its_first_position() -> None:
    digests, held = fragments()
    first, got = result_rows(digests, held, SID, 7, (2, 5), end=7)
    assert first == 3 and sorted(got) == [2, 5]
    np.testing.assert_array_equal(got[5], rows(4, 5, 3))


def test_a_fragment_that_did_not_come_gives_no_rows() -> None:
    """A verifier restarted after committing the round has its result, not its rows."""
    digests, held = fragments()
    assert result_rows(digests, {digests[0]: held[digests[0]]}, SID, 7, (2, 5), end=7) is None


def test_no_layers_no_rows() -> None:
    assert result_rows([], {}, SID, 7, (), end=9) == (9, {})


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (
            lambda d, h: (d[:1], h),
            r"names 1 capture fragments; the session captures layers \[2, 5\]",
        ),
        (lambda d, h: (d, {**h, d[1]: h[d[0]]}), "does not hash to its name"),
        (lambda d, h: (d[::-1], h), r"layer 5; expected .* layer 2"),
    ],
)
def test_a_fragment_missing_corrupted_or_substituted_is_refused(break_it, message) -> None:
    digests, held = fragments()
    digests, held = break_it(digests, held)
    with pytest.raises(RefusedError, match=message):
        result_rows(digests, held, SID, 7, (2, 5), end=7)


def test_another_sessions_or_rounds_rows_are_refused() -> None:
    for kw, message in [({"sid": OTHER}, "for session 6f6f"), ({"round_": 6}, "round 6 layer 2")]:
        digests, held = fragments(**kw)
        with pytest.raises(RefusedError, match=message):
            result_rows(digests, held, SID, 7, (2, 5), end=7)


def test_rows_that_stop_short_of_the_next_frontier_are_refused() -> None:
    digests, held = fragments()
    with pytest.raises(RefusedError, match=r"cover \[3, 7\); expected \[3, 8\)"):
        result_rows(digests, held, SID, 7, (2, 5), end=8)
    a = encode_capture(SID, 7, 2, 3, rows(4, 2, 3))
    b = encode_capture(SID, 7, 5, 4, rows(3, 5, 4))  # the same end, another start
    with pytest.raises(RefusedError, match=r"layer 5's capture rows cover \[4, 7\); expected \[3"):
        result_rows([a[0], b[0]], dict([a, b]), SID, 7, (2, 5), end=7)


def test_malformed_fragments_are_refused() -> None:
    w = Writer("capture").raw(SID, 16).u64(1).u32(2).u64(0).u32(2).u32(3).u32(32)
    with pytest.raises(RefusedError, match=r"dtype code 32; expected 16"):
        decode_capture(w.blob(b"\0" * 24).bytes())
    w = Writer("capture").raw(SID, 16).u64(1).u32(2).u64(0).u32(2).u32(3).u32(16)
    with pytest.raises(RefusedError, match=r"2 rows x 3 holds 10 bytes; expected 12"):
        decode_capture(w.blob(b"\0" * 10).bytes())
    with pytest.raises(CanonicalError):
        decode_capture(b"not a capture")
