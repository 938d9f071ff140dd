"""The proposer's journal under faults (issue 35): a journal that fails a write or an fsync
makes the daemon report NOT_SERVING and refuse new sessions until it reopens the journal
itself; a session's clients hear of its failure only once FAILED is durable (or are told
what a restart does with it); HTTP sessions, whose clients cannot reconnect, are ended by a
restart instead of being resumed for nobody. Each "kill" here is a copy of the journal's
directory taken at the instant in question, and a proposer started on the copy."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from muser.metrics import exposition
from muser.sampling import SamplingParams
from muser_app.cli.status import probe, state_line
from proposer_mac import journal
from proposer_mac.servicer import metrics_view
from proposer_mac.session import SessionFailed
from tests.core.fake_backend import FakeBackend
from tests.proposer.restart import proposer_again
from tests.proposer.test_failed_session import reject_round
from tests.proposer.test_generate_service import PARAMS, start, stop
from tests.verifier.conftest import PROMPT
from wal import _fs

pytestmark = pytest.mark.asyncio

RETRY_S = 0.2
LONG = SamplingParams(temperature=1.0, max_tokens=400, seed=7)


def journal_dir(c) -> Path:
    return Path(c.server.core.config.proposer.wal_dir) / "journal"


def fail_fsyncs_under(monkeypatch, directory: Path) -> None:
    """fsync fails with EIO for files under `directory` (the verifier's log, in this process
    too, keeps working)."""
    real = _fs.fsync_file

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(_fs, "fsync_file", fsync)


async def health_of(c) -> int:
    stub = health_pb2_grpc.HealthStub(c.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service="muser.v2.Proposer"))).status


async def until(predicate, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def killed_at_this_instant(c, tmp_path: Path, name: str):
    """The proposer's config on a copy of its journal as it is on disk right now."""
    config = c.server.core.config
    copy = tmp_path / name
    shutil.copytree(config.proposer.wal_dir, copy)
    return config.model_copy(
        update={"proposer": config.proposer.model_copy(update={"wal_dir": copy})}
    )


async def test_a_failed_journal_is_reported_refuses_sessions_and_is_reopened(
    key_set, tmp_path, monkeypatch
):
    c = await start(key_set, tmp_path, proposer={"journal_retry_s": RETRY_S})
    try:
        core = c.server.core
        assert await health_of(c) == health_pb2.HealthCheckResponse.SERVING
        runner = await core.start_session(PROMPT, LONG)
        await runner.wait_tokens(0)  # it runs
        fail_fsyncs_under(monkeypatch, journal_dir(c))
        await runner.task
        told = str(runner.error)
        assert "its failure could not be journaled" in told
        assert f"reconnect with session id {runner.session.session_id.hex()}" in told
        status = core.stats.faults["wal"]
        assert status.startswith("the session journal failed: fsync of ")
        assert "every 0.2 s (proposer.journal_retry_s)" in status
        assert await health_of(c) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert "muser_serving 0.0" in exposition(lambda: metrics_view(core)).decode()
        report = await asyncio.to_thread(probe, f"127.0.0.1:{c.port}", "proposer")
        assert report["serving"] is False  # `muser status` exits 1 and says why
        assert state_line(report) == f"NOT SERVING (wal: {status})"
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # a new session: retry later
            await c.generate(PARAMS, prompt_tokens=PROMPT)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the session journal failed" in refused.value.details()
        await asyncio.sleep(3 * RETRY_S)  # the disk still fails: it stays NOT_SERVING
        assert await health_of(c) == health_pb2.HealthCheckResponse.NOT_SERVING
        monkeypatch.undo()  # the disk is back: the journal is reopened within a retry

        async def serving() -> bool:
            return await health_of(c) == health_pb2.HealthCheckResponse.SERVING

        await until(serving)
        assert core.stats.faults == {}
        failed = core._replayed()[runner.session.session_id]
        assert failed.failed == "the session journal failed under it"  # never resumed
        events = await c.generate(PARAMS, prompt_tokens=PROMPT)  # and it serves again
        assert sum(len(e.tokens) for e in events) == PARAMS.max_tokens
    finally:
        await stop(c)


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs: a real filesystem that fills up."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:  # the injected-error test above covers the same paths
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {done.stderr.decode()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem is full."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\xff" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


async def test_a_full_filesystem_fails_the_session_and_the_journal_comes_back(
    key_set, tmp_path, tmpfs
):
    c = await start(
        key_set, tmp_path, proposer={"journal_retry_s": RETRY_S, "wal_dir": tmpfs / "proposer"}
    )
    try:
        core = c.server.core
        runner = await core.start_session(PROMPT, LONG)
        await runner.wait_tokens(0)
        filler = fill(tmpfs)
        await runner.task
        assert "No space left on device" in str(runner.error)
        assert "No space left on device" in core.stats.faults["wal"]
        assert await health_of(c) == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.sleep(3 * RETRY_S)  # still full
        assert await health_of(c) == health_pb2.HealthCheckResponse.NOT_SERVING
        filler.unlink()

        async def serving() -> bool:
            return await health_of(c) == health_pb2.HealthCheckResponse.SERVING

        await until(serving)
        assert core._replayed()[runner.session.session_id].failed is not None
        events = await c.generate(PARAMS, prompt_tokens=PROMPT)
        assert sum(len(e.tokens) for e in events) == PARAMS.max_tokens
    finally:
        await stop(c)


async def test_clients_hear_of_a_failure_only_once_it_is_journaled(key_set, tmp_path, monkeypatch):
    """Kill the proposer the instant a client hears that its session failed: the session
    restarts as failed, never resumed. FAILED's append is slowed here, so a client that asks
    while it is on its way would hear first if the failure were told before it is durable."""
    c = await start(key_set, tmp_path)
    try:
        core = c.server.core
        real_many = core.log.append_many_async

        async def slow_failed(payloads):
            if any(journal.describe(p)["entry"] == "failed" for p in payloads):
                await asyncio.sleep(0.3)
            return await real_many(payloads)

        async def slow_one(payload):
            return (await slow_failed([payload]))[0]

        monkeypatch.setattr(core.log, "append_many_async", slow_failed)
        monkeypatch.setattr(core.log, "append_async", slow_one)
        reject_round(monkeypatch, 3)
        runner = await core.start_session(PROMPT, LONG)
        offset, config = 0, None
        while config is None:  # a client asking again and again, each time afresh
            try:
                tokens, _ = await asyncio.wait_for(runner.wait_tokens(offset), 0.01)
                offset += len(tokens)
            except TimeoutError:
                continue
            except Exception:
                config = killed_at_this_instant(c, tmp_path, "at-the-failure")
        monkeypatch.undo()
        sid = runner.session.session_id
        async with proposer_again(config, c) as again:
            recovered = again.runners[sid]
            assert recovered.task is None  # not resumed
            with pytest.raises(SessionFailed, match="injected: round 3's result"):
                await recovered.wait_tokens(offset)
    finally:
        await stop(c)


async def test_a_restart_ends_detached_sessions_and_resumes_the_others(key_set, tmp_path):
    c = await start(key_set, tmp_path)
    try:
        core = c.server.core
        http = await core.start_session(PROMPT, LONG, detached=True)
        grpc_client = await core.start_session(PROMPT, LONG)
        await http.wait_tokens(0)
        await grpc_client.wait_tokens(0)
        config = killed_at_this_instant(c, tmp_path, "mid-run")
        sids = http.session.session_id, grpc_client.session.session_id
        async with proposer_again(config, c) as again:
            ended, resumed = (again.runners[sid] for sid in sids)
            assert ended.task is None
            with pytest.raises(SessionFailed, match="its client \\(an HTTP request\\) cannot"):
                await ended.wait_tokens(len(ended.session.emitted))
            assert resumed.task is not None  # a gRPC client reconnects for the rest
            await resumed.task
            assert resumed.error is None and len(resumed.session.emitted) == LONG.max_tokens
            assert again._replayed()[sids[0]].failed.startswith("the proposer restarted")
    finally:
        await stop(c)


class FlakyDraft(FakeBackend):
    """The tests' order-1 draft, whose forwards raise while `failing` is set."""

    failing = False

    def __init__(self):
        super().__init__(order=1, salt=1)

    def evaluate(self, tokens):
        if FlakyDraft.failing:
            raise RuntimeError("[metal] out of memory (simulated)")
        return super().evaluate(tokens)


async def test_a_draft_backend_that_raises_is_reported_until_a_draft_runs(key_set, tmp_path):
    c = await start(key_set, tmp_path, draft=FlakyDraft())
    try:
        core = c.server.core
        FlakyDraft.failing = True
        runner = await core.start_session(PROMPT, PARAMS)
        await runner.task
        assert "out of memory (simulated)" in str(runner.error)
        assert core.stats.faults == {
            "draft": "the draft backend raised RuntimeError('[metal] out of memory (simulated)')"
        }

        async def status_is(wanted: int):
            async def check() -> bool:
                return await health_of(c) == wanted

            return check

        await until(await status_is(health_pb2.HealthCheckResponse.NOT_SERVING))
        FlakyDraft.failing = False  # not a refusal of new sessions: the next draft clears it
        events = await c.generate(PARAMS, prompt_tokens=PROMPT)
        assert sum(len(e.tokens) for e in events) == PARAMS.max_tokens
        assert core.stats.faults == {}
        await until(await status_is(health_pb2.HealthCheckResponse.SERVING))
    finally:
        FlakyDraft.failing = False
        await stop(c)
