"""Pinning a process to CPUs (Linux `sched_setaffinity`).

A single-machine cluster stands for two machines: `config init` gives each daemon its own
CPUs (`verifier.cpus`, `proposer.cpus`), so the draft and the target do not trade one core,
and the bench runs its cluster client on the proposer's CPUs, where a client of the
proposer's machine would run. Affinity belongs to threads: `pin_process` sets it on every
thread the process has, and threads started later inherit it from the thread that starts
them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator

from muser.errors import RefusedError


class AffinityError(RefusedError):
    """CPUs asked for that this process may not run on, or a platform that cannot pin."""


def allowed() -> frozenset[int] | None:
    """The CPUs this process may run on now; None where the platform cannot pin (macOS)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def pinned_to() -> list[int] | None:
    """The CPUs this process is confined to, for status: None when it may run on every CPU
    of its machine, or the platform cannot pin. Decided here, on the daemon's machine: a
    `muser status` elsewhere cannot count this machine's CPUs."""
    have = allowed()
    if have is None or len(have) >= (os.cpu_count() or 0):
        return None
    return sorted(have)


def check(cpus: Iterable[int], where: str) -> frozenset[int]:
    """`cpus` as a set, refused unless this process may run on every one of them."""
    wanted = frozenset(cpus)
    have = allowed()
    if have is None:
        raise AffinityError(
            f"{where} {sorted(wanted)}: this platform cannot pin a process to CPUs "
            "(no sched_setaffinity); remove the setting"
        )
    if missing := sorted(wanted - have):
        raise AffinityError(
            f"{where} {sorted(wanted)} names CPU {missing[0]}, but this process may run on "
            f"CPUs {sorted(have)} only; name CPUs from those or remove the setting"
        )
    return wanted


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def pin_process(cpus: Iterable[int], where: str = "cpus") -> dict[int, frozenset[int]]:
    """Run every thread of this process on `cpus` (checked first: nothing changes when it
    is refused). Returns each thread's previous CPUs, for `restore`."""
    wanted = check(cpus, where)
    before = {}
    for tid in _threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            before[tid] = frozenset(os.sched_getaffinity(tid))
            os.sched_setaffinity(tid, wanted)
    return before


def restore(before: dict[int, frozenset[int]]) -> None:
    """Give each thread `pin_process` moved its CPUs back; threads started since get the
    main thread's."""
    fallback = before.get(os.getpid())
    for tid in _threads():
        cpus = before.get(tid, fallback)
        if cpus is not None:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def pinned(cpus: Iterable[int] | None, where: str = "cpus") -> Iterator[None]:
    """This process on `cpus` for the block (no change when `cpus` is None)."""
    if cpus is None:
        yield
        return
    before = pin_process(cpus, where)
    try:
        yield
    finally:
        restore(before)


SWITCH_INTERVAL_S = 0.0005
"""A daemon's GIL switch interval. The round's path hops between the event loop, the
draft/compute thread and the WAL flusher; CPython's default 5 ms would let a busy thread hold
the loop off that long at each hop."""


@contextlib.contextmanager
def serving(cpus: Iterable[int] | None, where: str, log: logging.Logger) -> Iterator[None]:
    """How a daemon's process runs while it serves: on `cpus` (`where` names the setting)
    with `SWITCH_INTERVAL_S`. Both are put back when it stops, so a daemon run in process
    (the tests' refused starts) leaves the process as it found it."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        with pinned(cpus, where):
            if cpus is not None:
                log.info("pinned to CPUs %s", list(cpus))
            yield
    finally:
        sys.setswitchinterval(interval)


def split_for_two(cpus: frozenset[int] | None) -> tuple[list[int], list[int]] | None:
    """Two disjoint halves of `cpus` (the proposer's first, the verifier's second), or None
    when there are fewer than two CPUs or the platform cannot pin."""
    if cpus is None or len(cpus) < 2:
        return None
    ordered = sorted(cpus)
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]
