"""`muser generate --lane cluster`'s client (`stream_generate`) against an in-process
proposer: what it raises, and so the exit code the CLI gives, for a refusal and a failure."""

from __future__ import annotations

import asyncio

import pytest

from muser.sampling import SamplingParams
from muser_app.cli.cluster_client import ClusterClientError, ClusterRefusedError, stream_generate
from tests.proposer.test_generate_service import PARAMS, PROMPT, start, stop


async def client(cluster, prompt, params: SamplingParams, **kw) -> dict:
    """The blocking client in a thread, so the daemons on this loop go on serving it."""
    return await asyncio.to_thread(
        stream_generate, f"127.0.0.1:{cluster.port}", prompt, params, reconnect_s=5.0, **kw
    )


@pytest.mark.asyncio
async def test_the_client_streams_the_session(key_set, tmp_path):
    c = await start(key_set, tmp_path)
    try:
        out = await client(c, PROMPT, PARAMS)
        events = await c.generate(PARAMS, prompt_tokens=PROMPT)
    finally:
        await stop(c)
    assert out["tokens"] == [t for e in events for t in e.tokens]
    assert len(out["tokens"]) == PARAMS.max_tokens and out["prompt_tokens"] == len(PROMPT)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("prompt", "params", "kw", "message"),
    [
        ("", PARAMS, {}, "INVALID_ARGUMENT: the prompt is empty"),
        ([1, 99], PARAMS, {}, "INVALID_ARGUMENT: prompt token 99 outside the vocabulary"),
        (PROMPT, SamplingParams(max_tokens=5000), {}, "exceeds the cluster limit"),
        (PROMPT, PARAMS, {"draft_len": 100}, "draft_len 100 is outside the cluster's lane range"),
    ],
)
async def test_a_refusal_exits_2_with_what_was_wrong(
    key_set, tmp_path, prompt, params, kw, message
):
    c = await start(key_set, tmp_path)
    try:
        with pytest.raises(ClusterRefusedError) as err:
            await client(c, prompt, params, **kw)
    finally:
        await stop(c)
    assert err.value.exit_code == 2
    assert f"proposer at 127.0.0.1:{c.port}: " in str(err.value) and message in str(err.value)


@pytest.mark.asyncio
async def test_a_failure_is_not_a_refusal(key_set, tmp_path, monkeypatch):
    """Results signed by a key the proposer did not enrol: the session fails (INTERNAL or
    the link's code), which is exit 3, not 2. The client knows the session's id from its
    first event, yet takes the failure as the proposer's answer: it does not reconnect."""
    from muser_app.cli import cluster_client

    def reconnect(self, exc):
        raise AssertionError(f"the client reconnected after the proposer's answer: {exc}")

    monkeypatch.setattr(cluster_client._Outage, "wait", reconnect)
    c = await start(key_set, tmp_path, enrol_stranger=True)
    try:
        with pytest.raises(ClusterClientError) as err:
            await client(c, PROMPT, PARAMS)
    finally:
        await stop(c)
    assert not isinstance(err.value, ClusterRefusedError)
    assert err.value.exit_code == 3


@pytest.mark.asyncio
async def test_a_verifier_that_is_down_is_named_and_unavailable(key_set, tmp_path, monkeypatch):
    """A new session whose open finds no verifier: UNAVAILABLE (not INTERNAL) with the
    verifier's address, after the open's wait (shortened here)."""
    import proposer_mac.context

    monkeypatch.setattr(proposer_mac.context, "OPEN_S", 1)
    c = await start(key_set, tmp_path)
    address = f"127.0.0.1:{c.verifier.port}"
    await c.verifier.stop()
    try:
        with pytest.raises(ClusterClientError) as err:
            await client(c, PROMPT, PARAMS)
    finally:
        await c.channel.close()
        await c.server.stop(None)
        await c.server.core.close()
    message = str(err.value)
    assert err.value.exit_code == 3 and not isinstance(err.value, ClusterRefusedError)
    assert f"UNAVAILABLE: open session: no answer from the verifier at {address} within 1 s" in (
        message
    )


def _scripted(monkeypatch, script):
    """`stream_generate` against a fake proposer whose Generate calls follow `script`: one
    list per call of events (pb.GenerateEvent), numbers (advance the fake clock by so many
    seconds) and "down" (the stream breaks: UNAVAILABLE). The fake clock also advances by
    every backoff sleep. Returns the requests the fake received."""
    import types

    import grpc

    import muser_app.cli.cluster_client as cc
    from muser.wire import muser_v2_pb2_grpc as pb_grpc

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "connection reset"

    now = [0.0]
    clock = types.SimpleNamespace(
        monotonic=lambda: now[0],
        perf_counter=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    requests, calls = [], iter(script)

    class Stub:
        def __init__(self, channel):
            pass

        def Generate(self, request):
            requests.append(request)
            for step in next(calls, ["down"]):
                if step == "down":
                    raise Unavailable()
                if isinstance(step, (int, float)):
                    now[0] += step
                    continue
                yield step

    monkeypatch.setattr(cc, "time", clock)
    monkeypatch.setattr(cc._Outage, "ready", lambda *a: None)  # no channel under the fake
    monkeypatch.setattr(pb_grpc, "ProposerStub", Stub)
    return requests


def _event(offset, tokens, done=False):
    from muser.wire import muser_v2_pb2 as pb

    return pb.GenerateEvent(
        session_id=b"s" * 16, offset=offset, tokens=tokens, text="", done=done, prompt_tokens=3
    )


def test_a_second_outage_gets_the_whole_reconnect_time_again(monkeypatch):
    """Regression: the deadline of the first outage was kept after the stream came back,
    so a second outage later in a long generation gave up at its first failure."""
    requests = _scripted(
        monkeypatch,
        [
            [_event(0, [1, 2]), "down"],
            ["down"],  # still down (50 ms of backoff so far)
            [_event(2, [3]), 1000.0, "down"],  # back, then 1000 s of tokens, then down again
            [_event(3, [4], done=True)],
        ],
    )
    out = stream_generate("127.0.0.1:1", PROMPT, PARAMS, reconnect_s=5.0)
    assert out["tokens"] == [1, 2, 3, 4]
    assert [(r.session_id, r.offset) for r in requests[1:]] == [
        (b"s" * 16, 2),
        (b"s" * 16, 2),
        (b"s" * 16, 3),
    ]


def test_an_outage_longer_than_reconnect_s_is_named(monkeypatch):
    requests = _scripted(monkeypatch, [[_event(0, [1]), "down"]])  # then down for good
    with pytest.raises(ClusterClientError) as err:
        stream_generate("127.0.0.1:1", PROMPT, PARAMS, reconnect_s=5.0)
    assert "proposer at 127.0.0.1:1 unreachable for 5s" in str(err.value)
    assert err.value.exit_code == 3
    # backoff 0.05, 0.1, 0.2, 0.4, 0.8, then 1 s: the try after 5 s of outage is the last
    assert len(requests) == 10


def test_a_proposer_that_never_answers_is_waited_for_then_named(tmp_path):
    """Nothing listens at the address: the client says it waits, then gives up (exit 3)
    instead of waiting for ever."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"  # closed below: nothing listens
    said, t0 = [], time.monotonic()
    with pytest.raises(ClusterClientError) as err:
        stream_generate(address, PROMPT, PARAMS, reconnect_s=2.0, on_wait=said.append)
    assert f"proposer at {address} unreachable for 2s" in str(err.value)
    assert err.value.exit_code == 3 and not isinstance(err.value, ClusterRefusedError)
    assert said == [f"waiting for the proposer at {address} (up to 2 s)"]
    assert 1.9 <= time.monotonic() - t0 < 10
