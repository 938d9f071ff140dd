"""The pinned MT19937 against the reference output vectors."""

import json
from pathlib import Path

import numpy as np
import pytest

from muser.mt19937 import STATE_BYTES, Mt19937

REFERENCE = json.loads(
    (Path(__file__).parent.parent / "data" / "mt19937_reference.json").read_text()
)

# The first outputs printed by the reference mt19937ar.c (init_by_array {0x123,...}).
PUBLISHED_FIRST_FIVE = [1067595299, 955945823, 477289528, 4107218783, 4228976476]


def test_init_genrand_5489_first_1000_outputs():
    rng = Mt19937.from_seed(5489)
    assert [rng.next_u32() for _ in range(1000)] == REFERENCE["init_genrand_5489"]


def test_init_by_array_first_1000_outputs():
    rng = Mt19937.from_key([0x123, 0x234, 0x345, 0x456])
    got = [rng.next_u32() for _ in range(1000)]
    assert got[:5] == PUBLISHED_FIRST_FIVE
    assert got == REFERENCE["init_by_array_123_234_345_456"]


def test_agrees_with_numpy_randomkit_far_into_the_stream():
    rng = Mt19937.from_seed(12345)
    bg = np.random.MT19937()
    bg._legacy_seeding(12345)
    expected = [int(x) for x in bg.random_raw(5000)]
    assert [rng.next_u32() for _ in range(5000)] == expected


def test_uniform_f64_is_genrand_res53():
    rng = Mt19937.from_key([0x123, 0x234, 0x345, 0x456])
    raw = REFERENCE["init_by_array_123_234_345_456"]
    for k in range(10):
        a, b = raw[2 * k] >> 5, raw[2 * k + 1] >> 6
        assert rng.uniform_f64() == (a * 67108864.0 + b) / 9007199254740992.0
    assert rng.draws == 10


def test_bytes_round_trip_mid_stream_resumes_identically():
    rng = Mt19937.from_seed(7)
    for _ in range(700):  # past one twist, mid-block
        rng.next_u32()
    data = rng.to_bytes()
    assert len(data) == STATE_BYTES == 2500
    clone = Mt19937.from_bytes(data)
    assert clone == rng
    assert [clone.next_u32() for _ in range(1500)] == [rng.next_u32() for _ in range(1500)]


def test_fresh_state_serialises_with_reference_index_624():
    data = Mt19937.from_seed(1).to_bytes()
    assert int.from_bytes(data[-4:], "little") == 624


@pytest.mark.parametrize("bad", [b"", b"\x00" * 2499, b"\x00" * 2501])
def test_from_bytes_refuses_wrong_length(bad):
    with pytest.raises(ValueError, match="2500 bytes"):
        Mt19937.from_bytes(bad)


def test_from_bytes_refuses_index_out_of_range():
    data = Mt19937.from_seed(1).to_bytes()[:-4] + (625).to_bytes(4, "little")
    with pytest.raises(ValueError, match="index"):
        Mt19937.from_bytes(data)


def test_negative_seed_and_empty_key_refused():
    with pytest.raises(ValueError, match="seed"):
        Mt19937.from_seed(-1)
    with pytest.raises(ValueError, match="key"):
        Mt19937.from_key([])


def test_copy_is_independent():
    rng = Mt19937.from_seed(3)
    other = rng.copy()
    rng.next_u32()
    assert other != rng
    assert other.next_u32() == Mt19937.from_seed(3).next_u32()


def test_compact_drops_the_draw_cache_and_the_stream_goes_on_unchanged():
    rng, ref = Mt19937.from_seed(9), Mt19937.from_seed(9)
    head = [rng.next_u32() for _ in range(100)]
    assert head == [ref.next_u32() for _ in range(100)]
    rng.compact()
    assert rng._tempered is None  # the ~22 KB of cached Python ints are gone
    assert [rng.next_u32() for _ in range(1000)] == [ref.next_u32() for _ in range(1000)]
