"""`muser generate --lane cluster`'s client (`stream_generate`) against an in-process
proposer: what it raises, and so the exit code the CLI gives, for a refusal and a failure."""

from __future__ import annotations

import asyncio

import pytest

from muser.cli.cluster_client import ClusterClientError, ClusterRefusedError, stream_generate
from muser.sampling import SamplingParams
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
async def test_a_failure_is_not_a_refusal(key_set, tmp_path):
    """Results signed by a key the proposer did not enrol: the session fails (INTERNAL or
    the link's code), which is exit 3, not 2."""
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
        c.server.core.log.close()
    message = str(err.value)
    assert err.value.exit_code == 3 and not isinstance(err.value, ClusterRefusedError)
    assert f"UNAVAILABLE: open session: no answer from the verifier at {address} within 1 s" in (
        message
    )
