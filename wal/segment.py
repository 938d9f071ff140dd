"""Byte-level encoding and parsing of the files drawn in `wal.log` (the format spec).

Pure functions over bytes: recovery (`wal.survey`), the tools and repair all call these, so
they cannot disagree about what a good record is.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import crc32c

from wal.errors import WalVersionError

FORMAT_VERSION = 1
SEGMENT_MAGIC = b"MUSERWAL"
SNAPSHOT_MAGIC = b"MUSERSNP"
RECORD_MARKER = b"\xa5WR\x5a"
SEGMENT_HEADER = struct.Struct("<8sIQI")  # magic, version, first_seq, crc32c(previous 20)
RECORD_HEADER = struct.Struct("<4sIIQ")  # marker, crc32c(length|seq|payload), length, seq
SNAPSHOT_HEADER = struct.Struct("<8sIQQI")  # magic, version, seq, length, crc32c(...)
MAX_RECORD_BYTES = 1 << 30  # format limit; a log may configure a lower one

SEGMENT_RE = re.compile(r"^seg-(\d{20})\.wal$")
SNAPSHOT_RE = re.compile(r"^snap-(\d{20})\.snap$")


def segment_name(first_seq: int) -> str:
    return f"seg-{first_seq:020d}.wal"


def snapshot_name(seq: int) -> str:
    return f"snap-{seq:020d}.snap"


def encode_segment_header(first_seq: int) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, first_seq, 0)[:20]
    return head + struct.pack("<I", crc32c.crc32c(head))


def encode_record(seq: int, payload: bytes) -> bytes:
    """marker | crc | length | seq | payload, the crc covering length, seq and payload."""
    tail = struct.pack("<IQ", len(payload), seq)
    crc = crc32c.crc32c(payload, crc32c.crc32c(tail))
    return RECORD_MARKER + struct.pack("<I", crc) + tail + payload


def encode_snapshot(seq: int, data: bytes) -> bytes:
    head = struct.pack("<IQQ", FORMAT_VERSION, seq, len(data))
    crc = crc32c.crc32c(data, crc32c.crc32c(head))
    return SNAPSHOT_MAGIC + head + struct.pack("<I", crc) + data


def _check_version(version: int, what: str) -> None:
    if version != FORMAT_VERSION:
        raise WalVersionError(
            f"{what} has format version {version}; this build reads version "
            f"{FORMAT_VERSION} only. Open it with the build that wrote it."
        )


def parse_segment_header(data: bytes, name: str, first_seq: int) -> str | None:
    """None if the header is good, else the reason it is not. Raises WalVersionError."""
    size = SEGMENT_HEADER.size
    if len(data) < size:
        return f"segment header truncated ({len(data)} of {size} bytes)"
    magic, version, seq, crc = SEGMENT_HEADER.unpack_from(data)
    if magic != SEGMENT_MAGIC:
        return f"segment header magic {magic!r}, expected {SEGMENT_MAGIC!r}"
    if crc32c.crc32c(data[:20]) != crc:
        return "segment header checksum mismatch"
    _check_version(version, name)
    if seq != first_seq:
        return f"segment header says first seq {seq} but the file name says {first_seq}"
    return None


@dataclass(frozen=True)
class BadSpot:
    """The first byte range of a segment that is not a good record."""

    offset: int
    reason: str
    torn: bool  # the damage a crash can leave: nothing valid follows it and it is no header


@dataclass
class SegmentScan:
    """What one pass over a segment's bytes found; payloads are sliced out lazily."""

    name: str
    first_seq: int
    data: bytes
    offsets: list[int]  # record start offsets, in order; record i has seq first_seq + i
    end: int  # offset just past the last good record
    bad: BadSpot | None

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.offsets)

    def payload(self, index: int) -> bytes:
        start = self.offsets[index]
        (length,) = struct.unpack_from("<I", self.data, start + 8)
        body = start + RECORD_HEADER.size
        return self.data[body : body + length]


def check_record(data: bytes, offset: int, max_bytes: int = MAX_RECORD_BYTES) -> tuple:
    """(seq, length, None) for a record whose checksum holds at `offset`, else (0, 0, why)."""
    size = RECORD_HEADER.size
    left = len(data) - offset
    if left < size:
        return 0, 0, f"partial record header ({left} of {size} bytes)"
    marker, crc, length, seq = RECORD_HEADER.unpack_from(data, offset)
    if marker != RECORD_MARKER:
        return 0, 0, f"record marker {marker!r}, expected {RECORD_MARKER!r}"
    if length > max_bytes or size + length > left:
        return 0, 0, f"record length {length} runs past the end of the file ({left} bytes left)"
    body = offset + size
    actual = crc32c.crc32c(data[body : body + length], crc32c.crc32c(data[offset + 8 : body]))
    if actual != crc:
        return 0, 0, f"record checksum mismatch (stored {crc:#010x}, computed {actual:#010x})"
    return seq, length, None


def find_valid_record(data: bytes, start: int, min_seq: int) -> int | None:
    """Offset of the first record at or after `start` whose checksum holds and whose seq is
    at least `min_seq`; the marker narrows the search so this is a bytes.find loop."""
    pos = data.find(RECORD_MARKER, start)
    while pos >= 0:
        seq, _, why = check_record(data, pos)
        if why is None and seq >= min_seq:
            return pos
        pos = data.find(RECORD_MARKER, pos + 1)
    return None


def scan_segment(data: bytes, name: str, first_seq: int) -> SegmentScan:
    """Walk a segment's records from its header until the end or the first bad record."""
    header_bad = parse_segment_header(data, name, first_seq)
    if header_bad is not None:
        return SegmentScan(name, first_seq, data, [], 0, BadSpot(0, header_bad, False))
    offsets: list[int] = []
    pos = SEGMENT_HEADER.size
    expected = first_seq
    while pos < len(data):
        seq, length, why = check_record(data, pos)
        if why is None and seq != expected:
            why = f"record has seq {seq} where {expected} was expected"
            bad = BadSpot(pos, why, False)
            return SegmentScan(name, first_seq, data, offsets, pos, bad)
        if why is not None:
            follower = find_valid_record(data, pos + 1, expected)
            if follower is not None:
                why += f"; a good record follows at byte offset {follower}"
            return SegmentScan(
                name, first_seq, data, offsets, pos, BadSpot(pos, why, follower is None)
            )
        offsets.append(pos)
        pos += RECORD_HEADER.size + length
        expected += 1
    return SegmentScan(name, first_seq, data, offsets, pos, None)


@dataclass(frozen=True)
class SnapshotFile:
    seq: int
    data: bytes


def parse_snapshot(raw: bytes, name: str, seq: int) -> tuple[SnapshotFile | None, int, str]:
    """(snapshot, 0, "") when good, else (None, offset, reason). Raises WalVersionError."""
    size = SNAPSHOT_HEADER.size
    if len(raw) < size:
        return None, len(raw), f"snapshot header truncated ({len(raw)} of {size} bytes)"
    magic, version, stored_seq, length, crc = SNAPSHOT_HEADER.unpack_from(raw)
    if magic != SNAPSHOT_MAGIC:
        return None, 0, f"snapshot magic {magic!r}, expected {SNAPSHOT_MAGIC!r}"
    if len(raw) != size + length:
        return None, size, f"snapshot holds {len(raw) - size} data bytes, header says {length}"
    actual = crc32c.crc32c(raw[size:], crc32c.crc32c(raw[8:28]))
    if actual != crc:
        return None, 0, f"snapshot checksum mismatch (stored {crc:#010x}, computed {actual:#010x})"
    _check_version(version, name)
    if stored_seq != seq:
        return None, 0, f"snapshot header says seq {stored_seq} but the file name says {seq}"
    return SnapshotFile(seq, raw[size:]), 0, ""
