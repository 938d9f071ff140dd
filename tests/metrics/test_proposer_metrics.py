"""The proposer's stats, in process against an in-process verifier (fake backends): its
sessions' rounds summed at scrape time, its journal fsyncs, its Generate refusals."""

from __future__ import annotations

import json

import grpc
import pytest
import pytest_asyncio

from muser.metrics import exposition
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from proposer_mac.servicer import metrics_view
from tests.metrics.test_exporter import samples
from tests.proposer.test_generate_service import start
from tests.verifier.conftest import PROMPT
from verifier_gx.servicer import metrics_view as verifier_view

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def pair(key_set, tmp_path):
    c = await start(key_set, tmp_path)
    yield c
    await c.channel.close()
    await c.server.stop(None)
    await c.server.core.close()
    await c.verifier.stop()


async def test_proposer_counters_equal_what_clients_received(pair):
    runs = [
        await pair.generate(
            SamplingParams(temperature=1.0, max_tokens=30, seed=s), prompt_tokens=PROMPT
        )
        for s in (1, 2)
    ]
    received = sum(len(e.tokens) for events in runs for e in events)
    rounds = sum(json.loads(events[-1].stats_json)["rounds"] for events in runs)
    with pytest.raises(grpc.aio.AioRpcError):
        await pair.generate(SamplingParams(max_tokens=5000), prompt_tokens=PROMPT)

    got = samples(exposition(lambda: metrics_view(pair.server.core)))
    assert received == 60 and got[("muser_emitted_tokens_total", ())] == received
    assert got[("muser_rounds_total", ())] == rounds
    assert got[("muser_tokens_per_round_sum", ())] == received
    for phase in ("draft", "transport", "verify", "wal", "sign"):
        assert got[("muser_round_phase_seconds_count", (("phase", phase),))] == rounds
    assert got[("muser_wal_fsync_seconds_count", ())] > 0  # PREPARED and COMMITTED fsyncs
    refused = ("muser_refusals_total", (("code", "INVALID_ARGUMENT"), ("reason", "refused")))
    assert got[refused] == 1.0
    verifier = samples(exposition(lambda: verifier_view(pair.verifier.manager)))
    assert verifier[("muser_rounds_total", ())] >= got[("muser_rounds_total", ())]
    assert verifier[("muser_emitted_tokens_total", ())] == received

    status = json.loads((await pair.stub.Status(pb.StatusRequest())).json)
    assert status["sessions"] == 2 and status["emitted"] == received
    assert status["refusals"] == {"refused": 1}
    assert status["wal"]["bytes"] > 0 and status["wal"]["fsync_p99_s"] > 0
