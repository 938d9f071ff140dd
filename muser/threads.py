"""A daemon's worker threads, started whole.

Each daemon hands its blocking work (the verifier's target forwards and fsyncs, fragment
writes, compaction; the proposer's journal and tokenizer calls) to its event loop's default
executor through `asyncio.to_thread`. `ThreadPoolExecutor` starts a thread only when a task
finds none idle, so a pool grows towards its bound whenever a burst of calls first
overlaps, which may be hours into a run. Started whole, a daemon's thread count is level
from its first request: a thread that appears later is a leak (the soak holds that,
`muser_app.bench.soak.verdict`), not a pool reaching its bound.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

WORKERS = 6
"""The default executor's threads: Python's own bound on a 2-CPU machine (cpu_count + 4),
written down so that it does not move with the machine the daemon starts on."""


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A `ThreadPoolExecutor` with all of its `workers` threads running: each of `workers`
    tasks waits at a barrier until every one has started, so each needs a thread of its own."""
    if workers < 1:
        raise ValueError(f"a pool needs at least one worker, got {workers}")
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait) for _ in range(workers)]:
        future.result()
    return pool


def start_default_executor(workers: int = WORKERS) -> ThreadPoolExecutor:
    """Give the running loop a default executor with all its threads started."""
    pool = started_pool(workers, "muser-io")
    asyncio.get_running_loop().set_default_executor(pool)
    return pool
