"""Capture fragments: the target's hidden rows at one capture layer, verifier → proposer
(docs/conditioned.md, docs/design.md §7). Content-addressed like every fragment (SHA-256 of these bytes) and
named, in the session's layer order, by the signed round result, so a corrupted or
substituted fragment is refused before the draft reads a row of it.

    "capture": session 16 | round u64 | layer u32 | first position u64 | rows u32 |
               width u32 | dtype u32 (16: float16) | blob of little-endian values, row-major

Which positions a round's rows cover (the carried frontier's geometry): every position the
round committed that the proposer has not been sent since the session was last opened on
this verifier — from position 0 (the prompt) for the first round after an open, else from
the round's frontier — up to the next frontier, whose rows exist only once the next round
evaluates it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from muser.canonical import Reader, Writer
from muser.errors import RefusedError
from muser.records import sha256

DOMAIN = "capture"
FLOAT16 = 16
"""The wire dtype code: float16, half the bytes of float32 (the draft reads its features
rounded to its declared dtype anyway)."""


@dataclass(frozen=True)
class CaptureRows:
    session_id: bytes
    round: int
    layer: int
    first: int
    """The position of rows[0] in the session's transcript."""
    rows: np.ndarray
    """(n, width) float32 (from float16 on the wire)."""


def encode_capture(session_id: bytes, round_: int, layer: int, first: int,
                   rows: np.ndarray) -> tuple[bytes, bytes]:  # fmt: skip
    """(digest, bytes) of one layer's rows starting at position `first`."""
    rows = np.ascontiguousarray(rows, dtype="<f2")
    if rows.ndim != 2:
        raise ValueError(f"capture rows must be 2-D (positions, width), got shape {rows.shape}")
    w = Writer(DOMAIN).raw(session_id, 16).u64(round_).u32(layer).u64(first)
    w.u32(rows.shape[0]).u32(rows.shape[1]).u32(FLOAT16).blob(rows.tobytes())
    data = w.bytes()
    return sha256(data), data


def decode_capture(data: bytes) -> CaptureRows:
    """The rows a capture fragment holds; CanonicalError/RefusedError when malformed."""
    r = Reader(data, DOMAIN)
    session_id, round_, layer, first = r.raw(16), r.u64(), r.u32(), r.u64()
    count, width, dtype = r.u32(), r.u32(), r.u32()
    blob = r.blob()
    r.end()
    if dtype != FLOAT16:
        raise RefusedError(f"capture fragment dtype code {dtype}; expected {FLOAT16} (float16)")
    if len(blob) != 2 * count * width:
        raise RefusedError(
            f"capture fragment of {count} rows x {width} holds {len(blob)} bytes; "
            f"expected {2 * count * width}"
        )
    rows = np.frombuffer(blob, dtype="<f2").reshape(count, width).astype(np.float32)
    return CaptureRows(session_id, round_, layer, first, rows)


def result_rows(
    digests: Sequence[bytes],
    fragments: Mapping[bytes, bytes],
    session_id: bytes,
    round_: int,
    layers: Sequence[int],
    end: int,
) -> tuple[int, dict[int, np.ndarray]] | None:
    """The rows a signed result names (`digests`, one per capture layer in `layers` order),
    from the fragments received: (first position, {layer: rows}), every layer covering
    [first, end), `end` the position of the round's next frontier. Refused (RefusedError,
    nothing returned) when a fragment does not hash to its name, belongs to another session,
    round or layer, or when the layers disagree on what they cover.

    None when a named fragment did not come: a verifier that answers a round it committed
    before a restart has its result but not the rows (they are not durable). The tokens stand
    on the signed result alone; the draft goes on with its own rows there, and the next round,
    the first since that open, sends the rows from position 0 again."""
    if len(digests) != len(layers):
        raise RefusedError(
            f"the result names {len(digests)} capture fragments; the session captures "
            f"layers {list(layers)}"
        )
    if any(d not in fragments for d in digests):
        return None
    first, out = None, {}
    for digest, layer in zip(digests, layers, strict=True):
        data = fragments[digest]
        if sha256(data) != digest:
            raise RefusedError(f"capture fragment {digest.hex()[:16]} does not hash to its name")
        got = decode_capture(data)
        where = (got.session_id, got.round, got.layer)
        if where != (session_id, round_, layer):
            raise RefusedError(
                f"capture fragment for session {got.session_id.hex()[:8]} round {got.round} "
                f"layer {got.layer}; expected {session_id.hex()[:8]} round {round_} layer {layer}"
            )
        if first is None:
            first = got.first
        if got.first != first or got.first + len(got.rows) != end:
            raise RefusedError(
                f"layer {layer}'s capture rows cover [{got.first}, {got.first + len(got.rows)});"
                f" expected [{first}, {end}) (up to the next frontier)"
            )
        out[layer] = got.rows
    return (end if first is None else first), out
