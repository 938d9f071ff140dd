"""The verifier's durable fragment store (verifier_gx.fragments over wal.fragments): what a
proposer sent survives a restart, so an open names it by digest and sends no bytes; what the
verifier derives from its own state of a session is never asked for; a corrupt stored copy
is asked for again and healed; a store that cannot write refuses nothing; what no open
session names is collected."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time

import grpc
import pytest

from muser.records import RoundResult, close_message
from muser.wire import muser_v2_pb2 as pb
from tests.verifier.test_open import refused
from tests.verifier.test_resume import PARAMS, SID, left_behind, move, node, reference, start

pytestmark = pytest.mark.asyncio
C = grpc.StatusCode


async def stored(v, digests, timeout: float = 10.0) -> None:
    """Wait until the verifier's store holds every one of `digests` (kept off the loop)."""
    store = v.manager.fragments.store
    deadline = time.monotonic() + timeout
    while not all(store.has(d.hex()) for d in digests):
        assert time.monotonic() < deadline, "the fragments never reached the store"
        await asyncio.sleep(0.01)


async def three_rounds_on_a(key_set, tmp_path, other):
    a = await start(key_set, node(key_set, tmp_path / "a", other))
    client = a.client(PARAMS, session_id=SID)
    await client.open_session()
    await client.run(await client.attach(), rounds=3)
    return a, client


async def all_but_the_state(b, client, other):
    """Point the session at B and resume there with every fragment but the MT state: B
    refuses it, naming the state, and keeps the rest in its store. Returns the transcript's
    chunk digests, every fragment, the resume point and what was sent."""
    _, chunks, fragments = client.resume_point()
    point = RoundResult.decode(client.results[-1].body)
    sent = {d: data for d, data in fragments.items() if d != point.post_state_digest}
    move(client, b, other[0].public_key())
    details = await refused(
        b, client.resume_session(fragments=sent), C.FAILED_PRECONDITION, "missing_fragments"
    )
    assert point.post_state_digest.hex()[:16] in details
    await stored(b, sent)
    return chunks, fragments, point, sent


async def test_fragments_a_proposer_sent_survive_the_verifiers_restart(key_set, tmp_path, other):
    out, head = await reference(key_set, tmp_path)
    a, client = await three_rounds_on_a(key_set, tmp_path, other)
    b_config = node(key_set, tmp_path / "b", other, own="other")
    b = await start(key_set, b_config)
    try:
        chunks, fragments, point, sent = await all_but_the_state(b, client, other)
        await b.stop()
        b = await start(key_set, b_config)  # memory stage empty: the store answers
        move(client, b, other[0].public_key())
        assert len(b.manager.fragments) == 0
        status = json.loads((await b.stub.Status(pb.StatusRequest())).json)
        assert status["fragments"]["stored"] == len(sent)
        state = {point.post_state_digest: fragments[point.post_state_digest]}
        reply = await client.resume_session(fragments=state)  # the rest by digest only
        assert reply.resumed and reply.next_round == 3
        await client.run(await client.attach())
        assert client.out == out and client.head == head
    finally:
        await a.stop()
        await b.stop()


async def test_a_verifier_left_behind_is_asked_only_for_what_it_lacks(key_set, tmp_path, other):
    out, head = await reference(key_set, tmp_path)
    a = await start(key_set, node(key_set, tmp_path / "a", other))
    b = await start(key_set, node(key_set, tmp_path / "b", other, own="other"))
    try:
        client = await left_behind(a, b, other, key_set)
        # A's store emptied: what A still has of the session is what it derives
        a.manager.fragments.store.gc((), now=time.time() + 1e6)
        assert a.manager.fragments.stored == 0
        _, chunks, fragments = client.resume_point()
        point = RoundResult.decode(client.results[-1].body)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.resume_session(fragments={})
        meta = dict(caught.value.trailing_metadata())
        named = {bytes.fromhex(d) for d in meta["muser-missing"].split(",")}
        # the prompt A derives from its own state; the transcript's one chunk moved on and
        # the MT state is the resume point's: those it lacks
        assert client.open.prompt_digest not in named
        assert named == {*chunks, point.post_state_digest}
        reply = await client.resume_session(fragments={d: fragments[d] for d in named})
        assert reply.resumed and reply.next_round == 5
        await client.run(await client.attach())
        assert client.out == out and client.head == head
    finally:
        await a.stop()
        await b.stop()


async def test_a_corrupt_stored_fragment_is_asked_for_again_and_healed(key_set, tmp_path, other):
    a, client = await three_rounds_on_a(key_set, tmp_path, other)
    b_config = node(key_set, tmp_path / "b", other, own="other")
    b = await start(key_set, b_config)
    try:
        chunks, fragments, point, _ = await all_but_the_state(b, client, other)
        await b.stop()
        victim = chunks[0].hex()
        path = b_config.verifier.wal_dir / "fragments" / "objects" / victim[:2] / victim
        path.write_bytes(b"\0" + path.read_bytes()[1:])
        b = await start(key_set, b_config)
        move(client, b, other[0].public_key())
        state = {point.post_state_digest: fragments[point.post_state_digest]}
        details = await refused(
            b, client.resume_session(fragments=state), C.FAILED_PRECONDITION, "missing_fragments"
        )
        assert victim[:16] in details  # the corrupt copy counts as missing, and is set aside
        assert (b_config.verifier.wal_dir / "fragments" / "quarantine").is_dir()
        again = {**state, chunks[0]: fragments[chunks[0]]}
        assert (await client.resume_session(fragments=again)).resumed
        await stored(b, [chunks[0]])
        assert b.manager.fragments.store.get(victim) == fragments[chunks[0]]
    finally:
        await a.stop()
        await b.stop()


async def test_a_store_that_cannot_write_refuses_nothing(key_set, tmp_path, other, caplog):
    out, head = await reference(key_set, tmp_path)
    a, client = await three_rounds_on_a(key_set, tmp_path, other)
    b = await start(key_set, node(key_set, tmp_path / "b", other, own="other"))
    calls = []

    def full(data):
        calls.append(len(data))
        raise OSError(errno.ENOSPC, "No space left on device")

    b.manager.fragments.store.put = full
    try:
        move(client, b, other[0].public_key())
        with caplog.at_level(logging.WARNING, logger="muser.verifier"):
            assert (await client.resume_session()).resumed
            await client.run(await client.attach())
            for _ in range(100):
                if "fragment store write failed" in caplog.text:
                    break
                await asyncio.sleep(0.01)
        assert calls and "No space left on device" in caplog.text
        assert client.out == out and client.head == head
        assert b.manager.fragments.stored == 0
    finally:
        await a.stop()
        await b.stop()


async def test_stored_fragments_no_open_session_names_are_collected(key_set, tmp_path, other):
    a, client = await three_rounds_on_a(key_set, tmp_path, other)
    b = await start(key_set, node(key_set, tmp_path / "b", other, own="other"))
    try:
        store = b.manager.fragments.store
        store.grace_seconds = 0
        _, chunks, fragments = client.resume_point()
        move(client, b, other[0].public_key())
        assert (await client.resume_session()).resumed
        await stored(b, fragments)
        # all named by the open session's committed records: none collected
        assert await b.manager.collect_fragments() == 0
        await client.run(await client.attach(), rounds=1)
        # the round moved the transcript's chunk and the MT state on: the old ones go, the
        # prompt (the session's open names it) stays
        assert await b.manager.collect_fragments() == 2
        assert store.digests() == [client.open.prompt_digest.hex()]
        sid, epoch = client.session_id, client.epoch
        await b.stub.CloseSession(
            pb.CloseSessionRequest(
                session_id=sid, epoch=epoch, signature=client.key.sign(close_message(sid, epoch))
            )
        )
        deadline = time.monotonic() + 10
        while store.digests():  # collected in the background once the session closed
            assert time.monotonic() < deadline, store.digests()
            await asyncio.sleep(0.01)
    finally:
        await a.stop()
        await b.stop()
