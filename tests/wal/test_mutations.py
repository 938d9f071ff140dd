"""Random truncations and bit flips of real segment files (seeded).

Each mutation has exactly one right outcome, computed from where the damage is:
- in the last record of the last segment, or a cut of the last segment after its header
  (what a crash can leave): open succeeds with exactly the records before the damage,
  byte for byte, and reports the torn tail (none when the cut fell on a record boundary);
- anywhere else: open refuses, naming the file and byte offset where good data ends, and
  `repair` then keeps exactly the records before the damage, moves the rest into
  quarantine (every damaged file's bytes are still there), and the log opens and appends.
Never a silently changed record: the only acceptable contents are a prefix of the original.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from wal import FileLog, repair_log
from wal.errors import WalCorruptionError
from wal.segment import SEGMENT_HEADER, scan_segment

SEGMENT_BYTES = 4096


@dataclass
class Layout:
    payloads: list[bytes]
    segments: list[Path]  # ascending
    records: list[list[tuple[int, int]]]  # per segment: (start, end) byte range of each record

    def before(self, index: int) -> int:
        """Records in the segments before segment `index`."""
        return sum(len(r) for r in self.records[:index])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Layout:
    directory = tmp_path_factory.mktemp("reference")
    rng = random.Random(2024)
    payloads = [rng.randbytes(rng.randrange(0, 400)) for _ in range(120)]
    with FileLog(directory, segment_bytes=SEGMENT_BYTES) as log:
        for payload in payloads:
            log.append(payload)
    segments = sorted(directory.glob("seg-*.wal"))
    records = []
    for path in segments:
        scan = scan_segment(path.read_bytes(), path.name, int(path.name[4:24]))
        assert scan.bad is None
        ends = [*scan.offsets[1:], scan.end]
        records.append(list(zip(scan.offsets, ends, strict=True)))
    assert len(segments) >= 5
    return Layout(payloads, segments, records)


def expected_outcome(layout: Layout, seg: int, kind: str, at: int) -> tuple[int, bool, str, int]:
    """(records kept, open succeeds, file named, offset named) for one mutation."""
    last = seg == len(layout.segments) - 1
    ranges = layout.records[seg]
    name = layout.segments[seg].name
    if at < SEGMENT_HEADER.size:  # a damaged header is never a torn tail
        return layout.before(seg), False, name, 0
    if kind == "truncate":
        whole = [r for r in ranges if r[1] <= at]
        kept = layout.before(seg) + len(whole)
        if last:
            return kept, True, name, 0
        if whole and whole[-1][1] == at or (not whole and at == SEGMENT_HEADER.size):
            # cut on a record boundary: the next segment then starts too late
            return kept, False, layout.segments[seg + 1].name, 0
        return kept, False, name, ranges[len(whole)][0]
    hit = next(i for i, (start, end) in enumerate(ranges) if start <= at < end)
    kept = layout.before(seg) + hit
    torn = last and hit == len(ranges) - 1
    return kept, torn, name, ranges[hit][0]


def mutate(rng: random.Random, layout: Layout, work: Path) -> tuple[int, str, int]:
    seg = rng.randrange(len(layout.segments))
    path = work / layout.segments[seg].name
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5:
        at = rng.randrange(len(data))
        with path.open("r+b") as handle:
            handle.truncate(at)
        return seg, "truncate", at
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return seg, "flip", at


def contents(directory: Path) -> set[bytes]:
    return {p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def run_trials(layout: Layout, root: Path, trials: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    source = layout.segments[0].parent
    counts = {"recovered": 0, "refused": 0}
    for trial in range(trials):
        work = root / f"t{trial}"
        shutil.copytree(source, work)
        seg, kind, at = mutate(rng, layout, work)
        kept, opens, name, offset = expected_outcome(layout, seg, kind, at)
        what = f"trial {trial}: {kind} {layout.segments[seg].name} at {at}"
        if opens:
            with FileLog(work, segment_bytes=SEGMENT_BYTES) as log:
                assert [r.payload for r in log.records()] == layout.payloads[:kept], what
                assert log.append(b"after") == kept + 1, what
            counts["recovered"] += 1
        else:
            damaged = contents(work)
            with pytest.raises(WalCorruptionError) as info:
                FileLog(work, segment_bytes=SEGMENT_BYTES)
            assert (info.value.path.name, info.value.offset) == (name, offset), what
            assert f"corrupt at byte offset {offset}" in str(info.value), what
            assert f"muser wal repair {work}" in str(info.value), what
            report = repair_log(work)
            assert report.changed, what
            assert damaged <= contents(work), f"{what}: repair lost bytes"
            with FileLog(work, segment_bytes=SEGMENT_BYTES) as log:
                assert [r.payload for r in log.records()] == layout.payloads[:kept], what
                assert log.append(b"after") == kept + 1, what
            counts["refused"] += 1
        shutil.rmtree(work)
    return counts


def test_150_random_truncations_and_bit_flips(reference, tmp_path):
    counts = run_trials(reference, tmp_path, trials=150, seed=7)
    assert counts["recovered"] + counts["refused"] == 150
    assert counts["recovered"] > 10 and counts["refused"] > 10


@pytest.mark.slow
def test_1000_random_truncations_and_bit_flips(reference, tmp_path):
    counts = run_trials(reference, tmp_path, trials=1000, seed=1000)
    assert counts["recovered"] + counts["refused"] == 1000
    assert counts["recovered"] > 100 and counts["refused"] > 100
