"""The pinned MT19937 stream (Matsumoto & Nishimura, 1998; reference `mt19937ar.c`).

Every random decision in a session draws from one of these, isolated from every library RNG,
so that a round can be replayed bit for bit on the other machine (docs/design.md §2). The API is
small and stable because other implementations call it:

    Mt19937.from_seed(int)      init_genrand
    Mt19937.from_key(list[int]) init_by_array
    .next_u32()                 genrand_int32
    .uniform_f64()              genrand_res53: [0, 1) with 53-bit resolution
    .to_bytes() / from_bytes()  624 state words + index, little-endian u32, 2,500 bytes
    .draws                      how many uniform_f64 values this object has drawn

The state words are held exactly as the reference holds `mt[]` (untempered) and the index is
the reference `mti`, so a serialised state resumes any conforming implementation. The twist
is vectorised with numpy in three dependency-respecting slices; tempering is applied to a whole
block at once and cached, which is what makes `next_u32` fast.
"""

from __future__ import annotations

import struct

import numpy as np

N = 624
M = 397
MATRIX_A = 0x9908B0DF
UPPER_MASK = 0x80000000
LOWER_MASK = 0x7FFFFFFF
STATE_BYTES = N * 4 + 4

_U32 = np.uint32


def _twist(mt: np.ndarray) -> np.ndarray:
    """One reference `genrand_int32` regeneration of all 624 words, vectorised.

    The reference loop updates mt[kk] in place, reading mt[kk+1] (still old) and
    mt[kk+M] or mt[kk+M-N] (already new when kk >= N-M). Slicing at the points where the
    second operand switches from old to new values reproduces the loop exactly.
    """
    out = mt.copy()
    mag = np.array([0, MATRIX_A], dtype=_U32)

    def mix(lo: int, hi: int, src: np.ndarray) -> None:
        y = (out[lo:hi] & _U32(UPPER_MASK)) | (mt[lo + 1 : hi + 1] & _U32(LOWER_MASK))
        out[lo:hi] = src ^ (y >> _U32(1)) ^ mag[y & _U32(1)]

    mix(0, N - M, mt[M:N])  # kk in [0, 227): reads old mt[kk+397]
    mix(N - M, 2 * (N - M), out[0 : N - M])  # kk in [227, 454): reads new mt[kk-227]
    mix(2 * (N - M), N - 1, out[N - M : N - 1 - (N - M)])  # kk in [454, 623)
    y = (out[N - 1] & _U32(UPPER_MASK)) | (out[0] & _U32(LOWER_MASK))
    out[N - 1] = out[M - 1] ^ (y >> _U32(1)) ^ mag[y & _U32(1)]
    return out


def _temper(mt: np.ndarray) -> list[int]:
    y = mt.copy()
    y ^= y >> _U32(11)
    y ^= (y << _U32(7)) & _U32(0x9D2C5680)
    y ^= (y << _U32(15)) & _U32(0xEFC60000)
    y ^= y >> _U32(18)
    return y.tolist()


def _init_genrand(seed: int) -> list[int]:
    mt = [0] * N
    mt[0] = seed & 0xFFFFFFFF
    for i in range(1, N):
        mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
    return mt


class Mt19937:
    """The reference MT19937 generator with a serialisable state."""

    __slots__ = ("_mt", "_mti", "_tempered", "draws")

    def __init__(self, words: np.ndarray, index: int) -> None:
        if words.shape != (N,):
            raise ValueError(f"MT19937 state needs {N} words, got shape {words.shape}")
        if not 0 <= index <= N:
            raise ValueError(f"MT19937 index must be in [0, {N}], got {index}")
        self._mt = words.astype(_U32, copy=True)
        self._mti = index
        self._tempered: list[int] | None = None
        self.draws = 0

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_seed(cls, seed: int) -> Mt19937:
        """Reference `init_genrand(seed)`; the seed is taken modulo 2**32."""
        if seed < 0:
            raise ValueError(f"MT19937 seed must be >= 0, got {seed}")
        return cls(np.array(_init_genrand(seed), dtype=_U32), N)

    @classmethod
    def from_key(cls, key: list[int]) -> Mt19937:
        """Reference `init_by_array(key)`; each key word is taken modulo 2**32."""
        if not key:
            raise ValueError("MT19937 key must hold at least one word, got []")
        mt = _init_genrand(19650218)
        i, j = 1, 0
        for _ in range(max(N, len(key))):
            prev = mt[i - 1] ^ (mt[i - 1] >> 30)
            mt[i] = ((mt[i] ^ (prev * 1664525)) + (key[j] & 0xFFFFFFFF) + j) & 0xFFFFFFFF
            i, j = i + 1, j + 1
            if i >= N:
                mt[0], i = mt[N - 1], 1
            if j >= len(key):
                j = 0
        for _ in range(N - 1):
            prev = mt[i - 1] ^ (mt[i - 1] >> 30)
            mt[i] = ((mt[i] ^ (prev * 1566083941)) - i) & 0xFFFFFFFF
            i += 1
            if i >= N:
                mt[0], i = mt[N - 1], 1
        mt[0] = 0x80000000
        return cls(np.array(mt, dtype=_U32), N)

    @classmethod
    def from_bytes(cls, data: bytes) -> Mt19937:
        """Inverse of `to_bytes`; refuses any other length."""
        if len(data) != STATE_BYTES:
            raise ValueError(f"MT19937 state must be {STATE_BYTES} bytes, got {len(data)}")
        words = np.frombuffer(data, dtype="<u4", count=N).astype(_U32)
        (index,) = struct.unpack_from("<I", data, N * 4)
        return cls(words, index)

    def to_bytes(self) -> bytes:
        return self._mt.astype("<u4").tobytes() + struct.pack("<I", self._mti)

    def copy(self) -> Mt19937:
        other = Mt19937(self._mt, self._mti)
        other._tempered = self._tempered
        other.draws = self.draws
        return other

    def compact(self) -> None:
        """Drop the tempered words cached for drawing (624 Python ints, ~22 KB); the next
        draw makes them again. For a state kept but no longer drawn from (an ended
        session that a daemon still remembers)."""
        self._tempered = None

    # --- drawing --------------------------------------------------------------------------

    def next_u32(self) -> int:
        """Reference `genrand_int32`."""
        if self._mti >= N:
            self._mt = _twist(self._mt)
            self._mti = 0
            self._tempered = None
        if self._tempered is None:
            self._tempered = _temper(self._mt)
        value = self._tempered[self._mti]
        self._mti += 1
        return value

    def uniform_f64(self) -> float:
        """Reference `genrand_res53`: a uniform in [0, 1) on a 2**-53 grid."""
        a = self.next_u32() >> 5
        b = self.next_u32() >> 6
        self.draws += 1
        return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mt19937) and self.to_bytes() == other.to_bytes()

    __hash__ = None  # type: ignore[assignment]
