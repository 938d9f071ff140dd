"""Draft rows travel packed (u32 ids and f64 weights as little-endian bytes) and are encoded
for signing in one vector pass; the canonical bytes are the ones the per-item encoding
writes, so nothing signed or journaled changes with the row's width."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from muser.canonical import CanonicalError, Reader, Writer
from muser.records import RoundRequest, Signed, request_of
from muser.sampling import SparseRow
from muser.wire import convert
from tests.wire.test_records_beside_bytes import KEY

SPECIAL = [0.0, -0.0, 1e-300, 5e-324, 0.1, 1.0 / 3.0, float("inf"), float("nan"), -2.5]


def per_item(ids: list[int], weights: list[float]) -> bytes:
    """The encoding as it was written before the vector pass: one struct item per entry."""
    return (
        Writer("t")
        .u32s(iter([int(i) for i in ids]))
        .f64s(iter([float(w) for w in weights]))
        .bytes()
    )


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint64])
def test_an_array_encodes_to_the_per_item_bytes(dtype):
    ids = np.array([0, 1, 7, 2047, min(np.iinfo(dtype).max, 2**32 - 1)], dtype=dtype)
    weights = np.array(SPECIAL[: ids.size])
    assert Writer("t").u32s(ids).f64s(weights).bytes() == per_item(ids.tolist(), SPECIAL[:5])
    assert Writer("t").u32s(ids[:0]).f64s(weights[:0]).bytes() == per_item([], [])


def test_every_float_keeps_its_bits():
    w = np.array(SPECIAL)
    data = Writer("t").f64s(w).bytes()
    assert data == Writer("t").f64s(iter(SPECIAL)).bytes()
    back = Reader(data, "t").f64_array()
    assert back.tobytes() == w.tobytes() and back.dtype == np.float64


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_an_id_outside_u32_is_refused_as_the_per_item_encoding_refuses_it(bad):
    with pytest.raises(struct.error):
        Writer("t").u32s(np.array([3, bad], dtype=np.int64))
    with pytest.raises(struct.error):
        Writer("t").u32s([3, bad])


def test_arrays_read_back_what_lists_read_back():
    ids, w = [2, 3, 2000], [0.5, 0.25, 0.125]
    data = per_item(ids, w)
    a, b = Reader(data, "t"), Reader(data, "t")
    got_ids, got_w = a.u32_array(), a.f64_array()
    a.end()
    assert got_ids.dtype == np.int64 and got_ids.tolist() == b.u32s() == ids
    assert got_w.tolist() == b.f64s() == w
    got_w[0] = 9.0  # a row read back is the caller's own array, not a view of the bytes


def wide_request(width: int) -> RoundRequest:
    rng = np.random.default_rng(width)
    rows = tuple(
        SparseRow(np.sort(rng.choice(4096, width, replace=False)), rng.random(width))
        for _ in range(4)
    )
    drafts = tuple(int(r.ids[0]) for r in rows)
    return RoundRequest(
        b"s" * 16, 3, 1, b"h" * 32, 11, drafts, rows, b"m" * 32, (b"t" * 32,), "kid", 1
    )


@pytest.mark.parametrize("width", [1, 32, 2048])
def test_a_wide_row_round_trips_through_protobuf_bit_for_bit(width):
    r = wide_request(width)
    signed = Signed.of(r, KEY.sign)
    m = convert.request_to_pb(signed)
    assert len(m.q_rows[0].ids) == 4 * width and len(m.q_rows[0].weights) == 8 * width
    back = convert.request_from_pb(type(m).FromString(m.SerializeToString()))
    assert back.body == signed.body and back.signature == signed.signature
    KEY.public_key().verify(back.signature, back.body)
    for qa, qb in zip(request_of(back).q_rows, r.q_rows, strict=True):
        assert qa.ids.tobytes() == qb.ids.astype(np.int64).tobytes()
        assert qa.weights.tobytes() == qb.weights.tobytes()
    decoded = RoundRequest.decode(signed.body)
    assert decoded.encode() == signed.body


@pytest.mark.parametrize(
    "field, data, expected",
    [("ids", b"\x01\x02\x03", "got 3 and 256 bytes"), ("weights", b"\x00" * 12, "got 128 and 12")],
)
def test_a_row_that_is_not_whole_packed_arrays_is_refused(field, data, expected):
    m = convert.request_to_pb(Signed.of(wide_request(32), KEY.sign))
    setattr(m.q_rows[1], field, data)
    with pytest.raises(CanonicalError, match=rf"draft row 1: .*{expected}"):
        convert.request_from_pb(m)
