"""A daemon's Python heap: what startup leaves is frozen out of the cyclic collector, and
every collection is timed.

After loading, a daemon holds about 380 000 objects (torch, transformers, gRPC, the
checkpoint's modules, the recovered sessions). CPython's full collection (generation 2)
walks every one of them: about 170 ms on this project's 2-core machine, with the GIL held,
so every thread of the daemon stops and a round in flight waits that long. It runs once the
objects that survived younger collections reach a quarter of those it walked last time, so
how often depends on what the daemon keeps per round (none ran in 3 400 rounds of one
session here; the five at startup took 535–644 ms together). Those objects live as long as
the process, so `settle` collects once and then freezes them (`gc.freeze`): later
collections walk only what came after (a full one here: under 1 ms). Reference counting
still frees a frozen object; only a cycle among frozen objects is never collected.

`GcWatch` times each collection (`gc.callbacks`), for `muser status` and `/metrics`.
"""

from __future__ import annotations

import gc
import time

GENERATIONS = (0, 1, 2)


def settle() -> int:
    """Collect what startup left behind, then freeze every object that survives (call it
    once the daemon has loaded everything it keeps). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcWatch:
    """Counts and times the cyclic collector's passes, per generation."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.pause_max_s = 0.0
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        # runs in whichever thread allocated its way into a collection, with the GIL held
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a collection
            return
        took = time.perf_counter() - self._started
        self._started = None
        generation = info["generation"]
        self.collections[generation] += 1
        self.pause_s[generation] += took
        self.pause_max_s = max(self.pause_max_s, took)

    @property
    def installed(self) -> bool:
        return self._callback in gc.callbacks

    def install(self) -> None:
        """Start timing collections (once; a second call changes nothing)."""
        if not self.installed:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._callback)
        self._started = None

    def status(self) -> dict:
        """Status JSON's `gc`: objects frozen, and (while installed) collections and their
        pauses per generation, the longest pause."""
        return {
            "frozen": gc.get_freeze_count(),
            "watched": self.installed,
            "collections": list(self.collections),
            "pause_s": list(self.pause_s),
            "pause_max_s": self.pause_max_s,
        }


WATCH = GcWatch()
"""The process's watch: a daemon installs it as it starts serving (`serving_heap`)."""


def serving_heap() -> int:
    """What a daemon does once it has loaded its models and recovered its log: freeze that
    heap and start timing collections. Returns the objects frozen."""
    frozen = settle()
    WATCH.install()
    return frozen
