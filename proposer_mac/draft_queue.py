"""The proposer's draft thread: every session's drafts and speculations, one thread, drafted
in lockstep when several wait at once (lane.draft_batch)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from muser.backend import MultiSequenceBackend
from muser.health import backend_failure
from muser.stats import DraftingStats
from proposer_mac.drafting import Drafter, Steps, run_together


@dataclass(frozen=True)
class _Job:
    drafter: Drafter
    steps: Steps
    future: Future


class DraftQueue:
    """The draft thread: drafts and speculations of every session, drafted in lockstep when
    several wait at once.

    A submitted job waits in a list and a drain is queued on the one-worker pool; a drain
    takes everything waiting, so jobs that arrive while the thread is busy are drafted
    together by the next one (no timer: nothing waits for company). With `batch_with` (the
    draft backend whose sequences the sessions draft on, lane.draft_batch) a group of two or
    more runs through `run_together`; a job alone, or every job without it, runs through
    its drafter's own cursor, the path of the local lane."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        batch_with: MultiSequenceBackend | None = None,
        on_draft: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.pool, self.batch_with = pool, batch_with
        self.on_draft = on_draft
        """Told after each group the exception its draft raised that is not a refusal of its
        round (the backend failed), or None when it ran (the daemon's health)."""
        self.stats = DraftingStats()
        self._waiting: list[_Job] = []
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Rounds submitted and not yet taken by the draft thread."""
        with self._lock:
            return len(self._waiting)

    @property
    def pending(self) -> int:
        """Jobs submitted whose result is not out yet (waiting, or in the draft thread)."""
        with self._lock:
            return self._pending

    def _done(self, n: int) -> None:
        with self._lock:
            self._pending -= n

    def draft(self, drafter: Drafter, steps: Steps) -> asyncio.Future:
        """Run `steps` in the draft thread; a future of (result, seconds). The seconds are
        the wall of the group it was drafted in: what this round waited for its draft."""
        job = _Job(drafter, steps, Future())
        with self._lock:
            self._waiting.append(job)
            self._pending += 1
        self.pool.submit(self._drain)
        return asyncio.wrap_future(job.future)

    def _drain(self) -> None:
        with self._lock:
            jobs, self._waiting = self._waiting, []
        taken = len(jobs)
        jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
        self._done(taken - len(jobs))  # cancelled while waiting
        for group in self._groups(jobs):
            t0 = time.perf_counter()
            if len(group) > 1:
                work = [(j.drafter.cursor, j.steps) for j in group]
                results = run_together(self.batch_with, work)
            else:
                results = [_run_alone(group[0])]
            seconds = time.perf_counter() - t0
            self.stats.observe_batch(len(group))
            self._done(len(group))
            self._tell(results)
            for job, result in zip(group, results, strict=True):
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result((result, seconds))

    def _tell(self, results: list) -> None:
        if self.on_draft is None:
            return
        with contextlib.suppress(Exception):  # health is reported, never a draft's failure
            self.on_draft(backend_failure(results))

    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        """The order `jobs` run in: layer k holds each session's k-th job (a draft on a
        decision comes after the speculation it replaces, never beside it: they share a
        cursor), and a layer of two or more runs as one group when sessions draft
        together."""
        layers: list[list[_Job]] = []
        for job in jobs:
            layer = next((x for x in layers if all(j.drafter is not job.drafter for j in x)), None)
            if layer is None:
                layers.append([job])
            else:
                layer.append(job)
        if self.batch_with is None:
            return [[j] for layer in layers for j in layer]
        return layers


def _run_alone(job: _Job) -> object:
    try:
        return job.drafter.run(job.steps)
    except Exception as exc:  # handed to the session that submitted it
        return exc
