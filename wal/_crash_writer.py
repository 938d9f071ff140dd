"""Crash-test writer: appends from several threads and acknowledges durable seqs on stdout.

    python -m wal._crash_writer DIR --run N [--threads T] [--segment-bytes B]
                                           [--snapshot-every K] [--split-writes]
                                           [--stall-at N]

The parent (tests/wal/test_crash.py) SIGKILLs it at a random point and then checks that
every acknowledged record is present and intact. An acknowledgement line "seq run thread
counter" is written with one os.write only after `append` returned, i.e. after the record
was durable. Payloads carry (run, thread, counter) and filler derived from them, so any
record read back can be checked byte for byte. Every K acknowledgements the main thread
writes a snapshot whose state is the ids of every record up to its seq, which exercises
snapshot writes and segment drops under the same random kills.
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import threading
import time
from pathlib import Path

from wal import _fs
from wal.log import FileLog
from wal.segment import RECORD_HEADER, RECORD_MARKER

ID = struct.Struct("<IHI")  # run, thread, counter


def make_payload(run: int, thread: int, counter: int) -> bytes:
    """Deterministic payload; one in 40 is a few KiB so a kill can tear it across pages."""
    rng = random.Random((run << 40) | (thread << 24) | counter)
    size = rng.randrange(2048, 9000) if rng.random() < 0.025 else rng.randrange(0, 300)
    return ID.pack(run, thread, counter) + rng.randbytes(size)


def parse_payload(payload: bytes) -> tuple[int, int, int]:
    """The (run, thread, counter) of a payload; ValueError if it is not exactly ours."""
    if len(payload) < ID.size:
        raise ValueError(f"payload of {len(payload)} bytes is shorter than its id")
    ident = ID.unpack_from(payload)
    if make_payload(*ident) != payload:
        raise ValueError(f"payload for id {ident} differs from the one that was appended")
    return ident


def pack_ids(ids: list[tuple[int, int, int]]) -> bytes:
    return b"".join(ID.pack(*i) for i in ids)


def unpack_ids(data: bytes) -> list[tuple[int, int, int]]:
    return [ID.unpack_from(data, at) for at in range(0, len(data), ID.size)]


def _split_writes(stall_at: int) -> None:
    """Issue each write(2) as many small ones, so a kill can land inside a record: what a
    kernel's partial write or a power cut leaves, produced here by a real SIGKILL.

    With stall_at > 0 the stall_at-th batch write stops inside its first record, prints
    "stall" and sleeps: the parent's kill then leaves a torn tail for certain.
    """
    whole = _fs.write_all
    rng = random.Random()
    batches = 0

    def write_in_pieces(fd: int, data: bytes) -> None:
        nonlocal batches
        view = memoryview(data)
        if data.startswith(RECORD_MARKER):
            batches += 1
            if batches == stall_at:
                (length,) = struct.unpack_from("<I", data, 8)
                whole(fd, view[: rng.randrange(1, RECORD_HEADER.size + length)])
                os.write(1, b"stall\n")
                time.sleep(3600)
        while view:
            cut = rng.randrange(1, 256)
            whole(fd, view[:cut])
            view = view[cut:]
            time.sleep(0.0001)  # widen the window in which the kill finds a half record

    _fs.write_all = write_in_pieces


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--run", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--segment-bytes", type=int, default=16384)
    parser.add_argument("--snapshot-every", type=int, default=0)
    parser.add_argument("--split-writes", action="store_true")
    parser.add_argument("--stall-at", type=int, default=0)
    args = parser.parse_args()
    if args.split_writes or args.stall_at:
        _split_writes(args.stall_at)
    log = FileLog(args.directory, segment_bytes=args.segment_bytes)
    snap = log.latest_snapshot()
    ids = unpack_ids(snap.data) if snap else []
    acked = threading.Semaphore(0)

    def appender(thread: int) -> None:
        counter = 0
        while True:
            seq = log.append(make_payload(args.run, thread, counter))
            os.write(1, f"{seq} {args.run} {thread} {counter}\n".encode())
            acked.release()
            counter += 1

    for thread in range(args.threads):
        threading.Thread(target=appender, args=(thread,), daemon=True).start()
    while True:  # runs until SIGKILL
        for _ in range(args.snapshot_every or 1 << 30):
            acked.acquire()
        ids += [parse_payload(r.payload) for r in log.records(len(ids) + 1)]
        log.write_snapshot(pack_ids(ids), seq=len(ids))


if __name__ == "__main__":
    main()
