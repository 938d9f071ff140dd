"""A daemon's default executor starts with all of its threads (muser.threads)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from muser import threads


def pool_threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_a_started_pool_has_every_thread_before_its_first_task():
    pool = threads.started_pool(5, "test-started")
    try:
        assert pool_threads("test-started") == 5
        for _ in range(3):  # tasks after the start make no new thread
            assert pool.submit(lambda: 7).result() == 7
        assert pool_threads("test-started") == 5
    finally:
        pool.shutdown()


def test_the_loops_default_executor_is_the_started_pool():
    async def main() -> tuple[int, str]:
        threads.start_default_executor(3)
        before = pool_threads("muser-io")
        name = await asyncio.to_thread(lambda: threading.current_thread().name)
        return before, name

    before, name = asyncio.run(main())
    assert before == 3
    assert name.startswith("muser-io")
    assert pool_threads("muser-io") == 0  # asyncio.run shut it down


def test_a_pool_without_workers_is_refused():
    with pytest.raises(ValueError, match="at least one worker, got 0"):
        threads.started_pool(0, "none")
