"""The verifier pool in process (proposer_mac.pool): a session whose first verifier does not
answer its open moves to the next one at a higher epoch, journaled before the open there;
an answer signed by another key than the pool lists for that verifier is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from cluster_config.schema import PoolVerifier
from muser.wire import muser_v2_pb2 as pb
from muser_app.cli.config import free_port
from proposer_mac import journal
from proposer_mac.link import RoundRefused
from tests.proposer.test_generate_service import PARAMS, start, stop
from tests.verifier.conftest import PROMPT

pytestmark = pytest.mark.asyncio


def verifier_entries(c) -> list:
    from verifier_gx import journal as vjournal

    return [vjournal.decode(r.payload) for r in c.verifier.manager.log.records(1)]


def dead_first(key_set, public_key: str = "verifier.pub"):
    """[verifier] at a port nothing listens on; the live verifier as [[pool]] "b", listed
    with `public_key`."""

    def edit(cfg):
        live = cfg.verifier.address
        member = PoolVerifier(
            name="b",
            address=live,
            public_key=key_set.dir / public_key,
            receipt=key_set.dir / "unused.json",
        )
        return cfg.model_copy(
            update={
                "verifier": cfg.verifier.model_copy(update={"address": f"127.0.0.1:{free_port()}"}),
                "proposer": cfg.proposer.model_copy(update={"failover_s": 0.3}),
                "pool": [member],
            }
        )

    return edit


async def test_a_session_whose_verifier_does_not_answer_its_open_moves_to_the_next(
    key_set, tmp_path
):
    c = await start(key_set, tmp_path, edit=dead_first(key_set))
    try:
        core = c.server.core
        runner = await core.start_session(PROMPT, PARAMS)
        await runner.task
        s = runner.session
        assert runner.error is None and len(s.emitted) == PARAMS.max_tokens
        assert (s.home, s.homes, s.epoch, s.moves) == ("b", ["verifier", "b"], 2, 1)
        assert core.pool.current == "b" and core.pool.moves == 1
        moved = [
            e for e in map(journal.describe, (r.payload for r in core.log.records()))
            if e["entry"] == "moved"
        ]  # fmt: skip
        assert [(e["epoch"], e["verifier"]) for e in moved] == [(1, "verifier"), (2, "b")]
        # the live verifier opened it at epoch 2 (its commit log) and closed it at the end
        opened = [e for e in verifier_entries(c) if getattr(e, "open", None) is not None]
        assert [(e.open.session_id, e.epoch) for e in opened] == [(s.session_id, 2)]
        assert s.session_id in c.verifier.manager.replay.closed
        # the next session opens there first
        second = await core.start_session(PROMPT, PARAMS)
        await second.task
        assert (second.session.homes, second.session.epoch) == (["b"], 1)
        status = json.loads((await c.stub.Status(pb.StatusRequest())).json)["pool"]
        assert status["current"] == "b" and status["moves"] == 1
        assert [v["name"] for v in status["verifiers"]] == ["verifier", "b"]
    finally:
        await stop(c)


async def test_a_verifier_answering_with_another_key_than_the_pool_lists_is_refused(
    key_set, tmp_path
):
    c = await start(key_set, tmp_path, edit=dead_first(key_set, "stranger.pub"))
    try:
        with pytest.raises(RoundRefused, match="pool verifier 'b' is key"):
            await c.server.core.start_session(PROMPT, PARAMS)
        kinds = [journal.describe(r.payload)["entry"] for r in c.server.core.log.records()]
        assert kinds == ["open", "moved", "moved", "failed"]  # no round was ever sent
    finally:
        await stop(c)


async def test_a_session_fenced_on_its_verifier_moves_to_the_next(key_set, tmp_path):
    """Its verifier refuses the session's epoch as stale (someone with the proposer's key
    opened it there at epoch 5): the session moves to the next verifier of the pool at a
    higher epoch and ends there with the tokens of an undisturbed run."""
    from tests.core.fake_backend import FakeBackend
    from tests.verifier.conftest import Verifier, make_config

    other = Verifier(make_config(key_set, tmp_path / "wal-b"), key_set, FakeBackend)
    await other.start()

    def edit(cfg):
        member = PoolVerifier(
            name="b",
            address=f"127.0.0.1:{other.port}",
            public_key=key_set.dir / "verifier.pub",
            receipt=key_set.dir / "unused.json",
        )
        return cfg.model_copy(update={"pool": [member]})

    params = dataclasses.replace(PARAMS, max_tokens=400)
    c = await start(key_set, tmp_path / "a", edit=edit)
    try:
        core = c.server.core
        plain = await core.start_session(PROMPT, params)
        await plain.task
        runner = await core.start_session(PROMPT, params)
        s = runner.session
        while runner.durable < 20:
            await asyncio.sleep(0.001)
        usurper = dataclasses.replace(s, epoch=5, signer=None)
        await core.context.open_remote(usurper, on=core.pool.members["verifier"])
        await runner.task
        assert runner.error is None and s.emitted == plain.session.emitted
        assert (s.homes, s.epoch, runner.stats.moves) == (["verifier", "b"], 2, 1)
        assert other.manager.stats.resumes == 1
    finally:
        await stop(c)
        await other.stop()
