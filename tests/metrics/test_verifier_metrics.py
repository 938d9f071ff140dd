"""The verifier's stats, observed by a real grpc.aio verifier on loopback (fake backend):
rounds, refusals by reason, WAL fsyncs, scraped over HTTP and reported by Status."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import aiohttp
import pytest

from muser.errors import RefusedError
from muser.metrics import exposition, serve_metrics
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from tests.metrics.test_exporter import samples
from verifier_gx.servicer import metrics_view

pytestmark = pytest.mark.asyncio

SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, seed=3)


async def refused_then_finished(verifier):
    """A whole session with one head_mismatch refusal in the middle."""
    client = verifier.client(SAMPLED)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=2)
    bad = dataclasses.replace(client.draft_request(), expected_head=os.urandom(32))
    msg, _ = await stream.round_trip(client.sign(bad))
    assert msg.error.reason == "head_mismatch"
    await client.run(stream)
    await stream.close()
    return client


async def test_counters_follow_the_rounds_and_the_refusal(verifier):
    client = await refused_then_finished(verifier)
    got = samples(exposition(lambda: metrics_view(verifier.manager)))
    rounds = len(client.results)
    assert got[("muser_rounds_total", ())] == rounds
    assert got[("muser_emitted_tokens_total", ())] == len(client.out) == SAMPLED.max_tokens
    assert got[("muser_tokens_per_round_count", ())] == rounds
    assert got[("muser_tokens_per_round_sum", ())] == len(client.out)
    assert 0.0 <= got[("muser_acceptance_ratio", ())] <= 1.0
    refused = ("muser_refusals_total", (("code", "ABORTED"), ("reason", "head_mismatch")))
    assert got[refused] == 1.0
    assert sum(v for (name, _), v in got.items() if name == "muser_refusals_total") == 1.0
    assert got[("muser_round_phase_seconds_count", (("phase", "verify"),))] == rounds
    # the session open and every round fsynced the commit log through FileLog(on_fsync)
    assert got[("muser_wal_fsync_seconds_count", ())] >= rounds + 1
    assert got[("muser_wal_fsync_seconds_sum", ())] > 0
    assert got[("muser_wal_bytes", ())] > 0
    assert got[("muser_sessions", ())] == 1.0


async def test_every_refusal_reason_gets_its_own_label(verifier):
    client = verifier.client(SAMPLED)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=1)
    request = client.draft_request()
    for bad, reason in (
        (dataclasses.replace(request, round=request.round + 1), "round_out_of_order"),
        (dataclasses.replace(request, epoch=request.epoch + 1), "future_epoch"),
        (dataclasses.replace(request, round=request.round + 1), "round_out_of_order"),
    ):
        msg, _ = await stream.round_trip(client.sign(bad))
        assert msg.error.reason == reason
    await stream.close()
    got = samples(exposition(lambda: metrics_view(verifier.manager)))
    refusals = {
        dict(labels)["reason"]: (dict(labels)["code"], v)
        for (name, labels), v in got.items()
        if name == "muser_refusals_total"
    }
    assert refusals == {
        "round_out_of_order": ("FAILED_PRECONDITION", 2.0),
        "future_epoch": ("FAILED_PRECONDITION", 1.0),
    }


async def test_metrics_over_http_and_status_json(verifier):
    client = await refused_then_finished(verifier)
    runner, port = await serve_metrics("127.0.0.1:0", lambda: metrics_view(verifier.manager))
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            got = samples(await resp.read())
    finally:
        await runner.cleanup()
    assert got[("muser_rounds_total", ())] == len(client.results)
    status = json.loads((await verifier.stub.Status(pb.StatusRequest())).json)
    assert status["rounds"] == len(client.results) and status["emitted"] == len(client.out)
    assert status["sessions"] == 1 and status["open_sessions"] == 0  # finished, not closed
    assert status["refusals"] == {"head_mismatch": 1}
    assert 0.0 <= status["acceptance"] <= 1.0 and status["tokens_per_s"] > 0
    wal = status["wal"]
    assert wal["bytes"] > 0 and wal["fsyncs"] >= len(client.results)
    assert 0 < wal["fsync_p50_s"] <= wal["fsync_p99_s"] <= wal["fsync_max_s"]


async def test_a_taken_metrics_port_is_refused():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RefusedError, match=f"127.0.0.1:{port}"):
            await serve_metrics(f"127.0.0.1:{port}", lambda: None)
