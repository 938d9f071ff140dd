"""Many sessions on one verifier, on real daemons: every concurrent session emits exactly
what plain target decode emits for its prompt (greedy), and the verifier's status accounts
for every round in its batches; the proposer drafts sessions together (lane.draft_batch).

Sampled concurrent sessions are not compared with the local lane token for token: a round
drafted in a batch has q rows equal to the lone ones only within float rounding. What holds
is that the verifier accepts every round (it replays each round's draws against the q rows
sent and refuses drafts the sampler would not pick) and each session runs to the end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from muser.sampling import SamplingParams
from muser_app.cli.cluster_client import stream_generate
from muser_app.cli.status import probe
from muser_app.fixtures import natural_prompts
from muser_app.lanes.plain import run_plain
from verifier_gx.backends import load_target_backend

SESSIONS = 6


def test_concurrent_sessions_each_equal_plain_decode(cluster, fixture_pair):
    tok = AutoTokenizer.from_pretrained(str(fixture_pair.target))
    prompts = [list(tok.encode(t, add_special_tokens=False)) for t in natural_prompts(SESSIONS)]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    target = load_target_backend("torch", fixture_pair.target)
    oracle = []
    for p in prompts:
        target.reset()
        oracle.append(run_plain(target, p, params).tokens)
    with ThreadPoolExecutor(max_workers=SESSIONS) as pool:
        got = list(pool.map(lambda p: stream_generate(cluster.address, p, params), prompts))
    for i, (g, want) in enumerate(zip(got, oracle, strict=True)):
        assert g["tokens"] == want, f"session {i} differs from plain decode"
        assert len(g["tokens"]) == 64
    status = probe(cluster.config.verifier.address, "verifier")["status"]
    batching = status["batching"]
    assert sum(int(k) * n for k, n in batching["batch_sizes"].items()) == status["rounds"]
    assert status["rounds"] == sum(g["stats"]["rounds"] for g in got)
    assert (batching["queue_depth"], batching["queue_full"]) == (0, 0)
    assert status["kv"]["per_session"] and status["kv"]["evictions"] == 0
    drafting = probe(cluster.address, "proposer")["status"]["drafting"]
    assert drafting["batch"] and max(map(int, drafting["batch_sizes"])) > 1  # batched for real


def test_concurrent_sampled_sessions_are_accepted_by_the_verifier_to_the_end(cluster, fixture_pair):
    tok = AutoTokenizer.from_pretrained(str(fixture_pair.target))
    prompts = [list(tok.encode(t, add_special_tokens=False)) for t in natural_prompts(SESSIONS)]
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=40 + i) for i in range(SESSIONS)]
    with ThreadPoolExecutor(max_workers=SESSIONS) as pool:
        got = list(pool.map(lambda p, q: stream_generate(cluster.address, p, q), prompts, params))
    assert [len(g["tokens"]) for g in got] == [64] * SESSIONS
    status = probe(cluster.config.verifier.address, "verifier")["status"]
    assert status["rounds"] == sum(g["stats"]["rounds"] for g in got)
    assert not status["refusals"], status["refusals"]
    drafting = probe(cluster.address, "proposer")["status"]["drafting"]
    assert max(map(int, drafting["batch_sizes"])) > 1
