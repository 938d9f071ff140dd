"""Canonical byte encoding, written out field by field (docs/design.md §7).

Everything that is signed or hashed is encoded here, never via protobuf serialisation:

    "MUSER" 0x00 | version u16 | domain (u16 length + ASCII) | fields in a fixed order

Field encodings (all little-endian): u32, u64, f64 (IEEE-754 bits), raw fixed-size bytes,
`blob` (u32 length + bytes), `text` (u32 length + UTF-8), `u32s`/`f64s`/`blobs`
(u32 count + items). A reader consumes exactly what a writer produced; trailing bytes or
a wrong domain/version are refused.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np

from muser.errors import RefusedError

MAGIC = b"MUSER\x00"
VERSION = 3
"""3: round requests carry decode_len, round results the decoded tokens."""


class CanonicalError(RefusedError):
    """Bytes that are not a valid canonical encoding of the expected record."""


def pack_u32s(vs: np.ndarray) -> bytes:
    """An integer array already known to lie in u32 as little-endian u32s (no count);
    `Writer.u32s` checks the range first, as `struct` would."""
    return vs.astype("<u4").tobytes()


def pack_f64s(vs: np.ndarray) -> bytes:
    """A float array as little-endian f64s (no count): IEEE-754 bits as `struct` writes them."""
    return np.asarray(vs).astype("<f8").tobytes()


def unpack_u32s(data: bytes | memoryview) -> np.ndarray:
    """`pack_u32s` read back, as int64 (the caller's own array); whole u32s only."""
    return np.frombuffer(data, dtype="<u4").astype(np.int64)


def unpack_f64s(data: bytes | memoryview) -> np.ndarray:
    """`pack_f64s` read back, as float64 (the caller's own array); whole f64s only."""
    return np.frombuffer(data, dtype="<f8").astype(np.float64)


def domain_of(data: bytes) -> str | None:
    """The domain a canonical record of this version names; None for anything else (a log
    holds several daemons' records, each interpreter reads its own)."""
    head = len(MAGIC) + 4
    if len(data) < head or bytes(data[: len(MAGIC)]) != MAGIC:
        return None
    version, dlen = struct.unpack_from("<HH", data, len(MAGIC))
    if version != VERSION or len(data) < head + dlen:
        return None
    return bytes(data[head : head + dlen]).decode("ascii", "replace")


class Writer:
    def __init__(self, domain: str) -> None:
        d = domain.encode("ascii")
        self.buf = bytearray(MAGIC + struct.pack("<HH", VERSION, len(d)) + d)

    def u32(self, v: int) -> Writer:
        self.buf += struct.pack("<I", v)
        return self

    def u64(self, v: int) -> Writer:
        self.buf += struct.pack("<Q", v)
        return self

    def f64(self, v: float) -> Writer:
        self.buf += struct.pack("<d", v)
        return self

    def raw(self, b: bytes, size: int) -> Writer:
        if len(b) != size:
            raise CanonicalError(f"expected {size} bytes, got {len(b)}")
        self.buf += b
        return self

    def blob(self, b: bytes) -> Writer:
        self.buf += struct.pack("<I", len(b)) + b
        return self

    def text(self, s: str) -> Writer:
        return self.blob(s.encode("utf-8"))

    def u32s(self, vs: Iterable[int]) -> Writer:
        if isinstance(vs, np.ndarray) and vs.ndim == 1 and vs.dtype.kind in "iu":
            if vs.size and (int(vs.min()) < 0 or int(vs.max()) >= 2**32):
                raise struct.error(f"u32 out of range: {vs.min()}..{vs.max()}")
            self.buf += struct.pack("<I", vs.size) + pack_u32s(vs)
            return self  # the same bytes as the loop below, in one vector pass
        vs = list(vs)
        self.buf += struct.pack(f"<I{len(vs)}I", len(vs), *vs)
        return self

    def f64s(self, vs: Iterable[float]) -> Writer:
        if isinstance(vs, np.ndarray) and vs.ndim == 1 and vs.dtype.kind == "f":
            self.buf += struct.pack("<I", vs.size) + pack_f64s(vs)
            return self  # the same bytes as the loop below, in one vector pass
        vs = list(vs)
        self.buf += struct.pack(f"<I{len(vs)}d", len(vs), *vs)
        return self

    def blobs(self, bs: Iterable[bytes]) -> Writer:
        bs = list(bs)
        self.u32(len(bs))
        for b in bs:
            self.blob(b)
        return self

    def bytes(self) -> bytes:
        return bytes(self.buf)


class Reader:
    def __init__(self, data: bytes, domain: str) -> None:
        self.data, self.pos = memoryview(data), 0
        if bytes(self._take(len(MAGIC))) != MAGIC:
            raise CanonicalError("not a muser canonical record (bad magic)")
        version, dlen = struct.unpack("<HH", self._take(4))
        got = bytes(self._take(dlen)).decode("ascii", "replace")
        if version != VERSION or got != domain:
            raise CanonicalError(f"expected {domain!r} v{VERSION}, got {got!r} v{version}")

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise CanonicalError(f"record truncated at byte {self.pos} (needed {n} more)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self._take(8))[0]

    def f64(self) -> float:
        return struct.unpack("<d", self._take(8))[0]

    def raw(self, size: int) -> bytes:
        return bytes(self._take(size))

    def blob(self) -> bytes:
        return bytes(self._take(self.u32()))

    def text(self) -> str:
        data = self.blob()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CanonicalError(
                f"a text field is not UTF-8 (byte {data[exc.start]:#04x} at {exc.start})"
            ) from None

    def u32s(self) -> list[int]:
        n = self.u32()
        return list(struct.unpack(f"<{n}I", self._take(4 * n)))

    def f64s(self) -> list[float]:
        n = self.u32()
        return list(struct.unpack(f"<{n}d", self._take(8 * n)))

    def u32_array(self) -> np.ndarray:
        """`u32s` as an int64 array (one vector pass, for long rows)."""
        return unpack_u32s(self._take(4 * self.u32()))

    def f64_array(self) -> np.ndarray:
        """`f64s` as a float64 array (one vector pass, for long rows)."""
        return unpack_f64s(self._take(8 * self.u32()))

    def blobs(self) -> list[bytes]:
        return [self.blob() for _ in range(self.u32())]

    def end(self) -> None:
        if self.pos != len(self.data):
            raise CanonicalError(f"{len(self.data) - self.pos} trailing bytes after the record")
