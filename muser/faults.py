"""Fault-injection points between the steps of the durable transaction (docs/design.md §6), for
the crash sweep (tests/cluster/test_fault_points.py).

    MUSER_TEST_CRASH_AT="verifier.after_compute@3"

A test-only setting: set in one daemon's environment, it makes that daemon SIGKILL itself
the 3rd time (default: the 1st) it reaches that point, after writing one line naming it to
stderr (the daemon's log). Unset, as in every real run, `reached` is one comparison. A point
this module does not name is refused when the daemon starts, naming every point (a typo
would otherwise arm nothing and the sweep would pass without a crash).

The points, in the order a round reaches them:

    proposer.after_prepared      PREPARED (with the round before's COMMITTED) fsynced, the
                                 request not yet sent
    verifier.after_closure       the request checked: signature, epoch, head, closure, drafts
    verifier.after_compute       witness rows evaluated, the round judged and signed, nothing
                                 written
    verifier.after_commit_fsync  the ROUND record fsynced, the session's head not yet moved
    verifier.after_emit          the signed result written to the proposer's stream
    proposer.after_committed     COMMITTED fsynced, its tokens not yet visible to clients
    proposer.after_emit          tokens handed to a client's stream
    proposer.after_ack           the round's ack written to the verifier
    verifier.after_ack           an ack taken: the fragments staged for the round released
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ENV = "MUSER_TEST_CRASH_AT"

POINTS = {
    "proposer": ("after_prepared", "after_committed", "after_emit", "after_ack"),
    "verifier": (
        "after_closure",
        "after_compute",
        "after_commit_fsync",
        "after_emit",
        "after_ack",
    ),
}
"""Each daemon's points, by role (the module note says where each one is)."""

ALL = tuple(f"{role}.{step}" for role, steps in POINTS.items() for step in steps)


class FaultSettingError(ValueError):
    """MUSER_TEST_CRASH_AT names no point, or a count that is not a positive integer."""


def parse(raw: str) -> tuple[str, int]:
    """(point, n) from "role.step[@n]"; FaultSettingError naming what is expected."""
    point, at, count = raw.partition("@")
    if point not in ALL:
        raise FaultSettingError(
            f"{ENV}={raw!r}: no fault point {point!r}; expected one of {', '.join(ALL)}, "
            "optionally followed by @N (crash the N-th time it is reached)"
        )
    if not at:
        return point, 1
    if not count.isdigit() or int(count) < 1:
        raise FaultSettingError(f"{ENV}={raw!r}: the count after @ is a positive integer")
    return point, int(count)


_armed = parse(os.environ[ENV]) if os.environ.get(ENV) else None
_lock = threading.Lock()
_seen = 0


def reached(point: str) -> None:
    """The daemon is at `point`: SIGKILL itself there when it is the armed point's N-th
    time. Safe from any thread (the verifier's commit runs in its worker thread)."""
    global _seen
    if _armed is None or point != _armed[0]:
        return
    with _lock:
        _seen += 1
        if _seen < _armed[1]:
            return
        sys.stderr.write(f"{ENV}: {point} reached (time {_seen}): SIGKILL\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
