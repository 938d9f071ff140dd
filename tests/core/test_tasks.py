"""Fire-and-forget coroutines: held until they end, their failures logged by name."""

from __future__ import annotations

import asyncio
import gc
import logging

from muser import tasks


def test_a_background_task_runs_to_its_end_though_nobody_holds_it():
    done = []

    async def work():
        await asyncio.sleep(0.01)
        done.append(True)

    async def main():
        tasks.in_background(work(), "the work")  # the returned task is dropped at once
        gc.collect()
        for _ in range(500):  # (a loaded machine may take a while to get there)
            if done and not tasks._held:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert done == [True] and not tasks._held


def test_a_failure_is_logged_with_what_it_was_and_not_raised(caplog):
    async def broken():
        raise RuntimeError("the stream is gone")

    async def main():
        task = tasks.in_background(broken(), "an ack")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return task

    with caplog.at_level(logging.WARNING, logger="muser"):
        task = asyncio.run(main())
    assert task.done() and isinstance(task.exception(), RuntimeError)
    assert "an ack failed: the stream is gone" in caplog.text
