"""Restart on the same commit log: sessions resume at the right round and head, later
rounds equal the uncrashed run; the journal interpreter checks chains and signatures."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from muser.canonical import CanonicalError
from muser.errors import JournalError
from muser.keys import key_id
from muser.records import Signed
from muser.sampling import SamplingParams
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import Verifier, make_config
from verifier_gx import journal
from verifier_gx.journal_check import VerifierJournal
from verifier_gx.replay import Replay
from wal.log import FileLog

PARAMS = SamplingParams(temperature=1.0, max_tokens=48, seed=21)


async def uncrashed(key_set, tmp_path) -> list[int]:
    v = await Verifier(make_config(key_set, tmp_path / "ref"), key_set, FakeBackend).start()
    try:
        client = v.client(PARAMS)
        await client.open_session()
        await client.run(await client.attach())
        return client.out
    finally:
        await v.stop()


@pytest.mark.asyncio
async def test_restart_resumes_at_the_committed_round_and_head(key_set, tmp_path):
    reference = await uncrashed(key_set, tmp_path)
    config = make_config(key_set, tmp_path / "wal")
    v = await Verifier(config, key_set, FakeBackend).start()
    client = v.client(PARAMS)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=3)
    in_flight = client.draft_request()  # sent, committed, but the reply is never read
    await stream.send(request=client.sign(in_flight))
    while v.manager.replay.sessions[client.session_id].next_round < 4:
        await asyncio.sleep(0.01)
    committed = v.snapshot(client.session_id)
    await v.stop()

    v2 = await Verifier(config, key_set, FakeBackend).start()  # fresh backend: KV rebuilt
    try:
        assert v2.snapshot(client.session_id) == committed
        client.stub = v2.stub  # the proposer reconnects and re-opens (idempotent)
        reply = await client.open_session(fragments={})
        assert (reply.next_round, reply.head) == (4, committed[2])
        stream = await client.attach()
        msg, _ = await stream.round_trip(client.sign(in_flight))  # the proposer's retry
        client.accept(in_flight, msg)
        assert client.head == committed[2]
        await client.run(stream)
        assert client.out == reference
        seq = v2.wal_seq
        # every committed round of the first run is still answered byte for byte
        first = client.results[0]
        stored = v2.manager.replay.sessions[client.session_id].committed[0][1]
        assert stored == first.encode()
        assert v2.wal_seq == seq
    finally:
        await v2.stop()


@pytest.mark.asyncio
async def test_journal_interpreter_verifies_and_names_the_first_bad_record(key_set, tmp_path):
    config = make_config(key_set, tmp_path / "wal")
    v = await Verifier(config, key_set, FakeBackend).start()
    client = v.client(PARAMS)
    await client.open_session()
    await client.run(await client.attach(), rounds=6)
    await v.stop()
    with FileLog(tmp_path / "wal" / "commit") as log:
        records = [(r.seq, r.payload) for r in log.records()]
    vkeys = {key_id(key_set.verifier.public_key()): key_set.verifier.public_key()}
    pkeys = {client.key_id: client.key.public_key()}
    interp = VerifierJournal()
    good = interp.verify(records, verifier_keys=vkeys, proposer_keys=pkeys)
    assert good.ok and good.records == 7
    assert good.sessions[0]["head"] == client.head.hex()
    assert good.sessions[0]["rounds"] == 6
    assert [interp.describe(p)["entry"] for _, p in records] == ["open"] + ["round"] * 6
    assert interp.matches(records[0][1]) and not interp.matches(b"not a record")

    # tamper with round 3's signature: the chain still holds, the signature does not
    seq, payload = records[4]
    entry = journal.decode(payload)
    signed = Signed.decode(entry.signed)
    forged = Signed(signed.body, bytes([signed.signature[0] ^ 1]) + signed.signature[1:])
    tampered = list(records)
    tampered[4] = (seq, journal.encode(dataclasses.replace(entry, signed=forged.encode())))
    report = interp.verify(tampered, verifier_keys=vkeys)
    assert not report.ok and report.first_bad.seq == seq
    assert "signature" in report.first_bad.reason
    assert interp.verify(tampered).ok  # without keys only the chain is checked

    # a broken chain is named without keys
    swapped = list(records)
    swapped[3], swapped[4] = swapped[4], swapped[3]
    report = interp.verify(swapped)
    assert report.first_bad.seq == records[4][0] and "round" in report.first_bad.reason

    # the daemon refuses to start on the tampered log
    bad_dir = tmp_path / "bad"
    with FileLog(bad_dir / "commit") as log:
        for _, p in tampered:
            log.append(p)
    with pytest.raises(JournalError, match=f"record {seq}"):
        await Verifier(make_config(key_set, bad_dir), key_set, FakeBackend).start()
    with FileLog(bad_dir / "commit"):  # the refused start released the log
        pass


@pytest.mark.asyncio
async def test_a_closed_session_leaves_only_its_summary(key_set, tmp_path):
    """Closed sessions are refused whatever they held, so the daemon and a replay of its log
    keep only their summaries: memory does not grow with the tokens of sessions served."""
    import tracemalloc

    from muser.records import close_message
    from muser.wire import muser_v2_pb2 as pb

    config = make_config(key_set, tmp_path / "wal")
    v = await Verifier(config, key_set, FakeBackend).start()
    summaries = {}
    try:
        for _ in range(4):
            client = v.client(PARAMS)
            await client.open_session()
            await client.run(await client.attach())
            sid = client.session_id
            summaries[sid] = v.manager.replay.sessions[sid].summary()
            signature = client.key.sign(close_message(sid, 1))
            await v.stub.CloseSession(
                pb.CloseSessionRequest(session_id=sid, epoch=1, signature=signature)
            )
        assert {sid: c.summary() for sid, c in v.manager.replay.closed.items()} == summaries
        assert all(s["emitted"] == PARAMS.max_tokens for s in summaries.values())
    finally:
        await v.stop()
    with FileLog(tmp_path / "wal" / "commit") as log:
        records = [(r.seq, r.payload) for r in log.records()]
    report = VerifierJournal().verify(records)  # `muser wal verify`: the same summaries
    assert report.ok and report.sessions == [
        dict(summaries[sid], closed=True) for sid in sorted(summaries)
    ]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        replay = Replay()
        for _, payload in records:
            replay.apply(journal.decode(payload))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(replay.closed) == 4 and not replay.sessions
    assert held < 4 * 2048, f"{held} bytes held for 4 closed sessions"


def test_entries_round_trip_and_refuse_garbage():
    e = journal.EpochEntry(b"\x01" * 16, 7)
    assert journal.decode(journal.encode(e)) == e
    c = journal.CloseEntry(b"\x02" * 16)
    assert journal.decode(journal.encode(c)) == c
    with pytest.raises(CanonicalError):
        journal.decode(journal.encode(c) + b"\x00")
    with pytest.raises(CanonicalError, match="tag 9"):
        journal.decode(journal.encode(c).replace(b"\x04\x00\x00\x00", b"\x09\x00\x00\x00", 1))
