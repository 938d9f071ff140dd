"""The cluster lane on real daemons emits exactly what the oracle and the local lane emit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from muser.sampling import SamplingParams
from muser.width import FixedWidth
from muser_app.cli.cluster_client import stream_generate
from muser_app.fixtures import natural_prompts
from muser_app.lanes.local import run_local
from muser_app.lanes.plain import run_plain
from proposer_mac.backends import load_draft_backend
from tests.cluster.harness import muser
from verifier_gx.backends import load_target_backend


@pytest.fixture(scope="module")
def models(fixture_pair):
    tok = AutoTokenizer.from_pretrained(str(fixture_pair.target))
    target = load_target_backend("torch", fixture_pair.target)
    draft = load_draft_backend("torch", fixture_pair.draft)
    return tok, target, draft


def encode(tok, text):
    return list(tok.encode(text, add_special_tokens=False))


def test_greedy_cluster_equals_plain_on_8_natural_prompts_x_256(cluster, models):
    tok, target, _ = models
    params = SamplingParams(temperature=0.0, max_tokens=256)
    for i, text in enumerate(natural_prompts(8)):
        prompt = encode(tok, text)
        target.reset()
        oracle = run_plain(target, prompt, params).tokens
        got = stream_generate(cluster.address, prompt, params)
        assert got["tokens"] == oracle, f"prompt {i}: cluster differs from plain decode"
        assert len(got["tokens"]) == 256


def test_sampled_cluster_equals_local_lane_token_for_token(cluster, models):
    tok, target, draft = models
    for seed, (temperature, top_k, top_p) in enumerate([(1.0, 0, 1.0), (0.8, 40, 0.95)]):
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=96, seed=100 + seed
        )
        prompt = encode(tok, natural_prompts(2)[seed])
        target.reset()
        draft.reset()
        k = cluster.config.lane.q_top_k
        local = run_local(target, draft, prompt, params, draft_len=4, q_top_k=k).tokens
        got = stream_generate(cluster.address, prompt, params)
        assert got["tokens"] == local


def test_generate_cli_cluster_json_has_the_local_lane_shape(cluster):
    out = muser(
        "generate",
        "--lane",
        "cluster",
        "--config",
        str(cluster.config_path),
        "--prompt",
        "def main(args):\n",
        "--max-tokens",
        "24",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["lane"] == "cluster"
    assert len(result["tokens"]) == 24
    assert {
        "rounds",
        "drafted",
        "accepted",
        "acceptance",
        "tokens_per_round",
        "wall_s",
        "tokens_per_s",
    } <= result["stats"].keys()
    local = muser(
        "generate",
        "--lane",
        "local",
        "--prompt",
        "def main(args):\n",
        "--max-tokens",
        "24",
        "--json",
    )
    assert json.loads(local.stdout)["tokens"] == result["tokens"]


def test_status_waits_for_both_daemons_and_says_where_they_run_and_their_heap(cluster):
    out = muser("status", "--config", str(cluster.config_path), "--wait", "60", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["healthy"] and report["verifier"]["serving"] and report["proposer"]["serving"]
    for role, daemon in (("verifier", cluster.verifier), ("proposer", cluster.proposer)):
        # config init split this machine's CPUs; every thread of the daemon runs on its half
        wanted = getattr(cluster.config, role).cpus or sorted(os.sched_getaffinity(0))
        tasks = Path(f"/proc/{daemon.proc.pid}/task")
        assert {tuple(sorted(os.sched_getaffinity(int(t.name)))) for t in tasks.iterdir()} == {
            tuple(wanted)
        }, role
        # status names the CPUs the daemon is confined to (None: every CPU of its machine)
        confined = wanted if len(wanted) < (os.cpu_count() or 0) else None
        assert report[role]["status"]["cpus"] == confined
        # the daemon froze its loaded heap out of the cyclic collector and times its passes
        gc = report[role]["status"]["gc"]
        assert gc["watched"] and gc["frozen"] > 100_000, gc


@pytest.mark.parametrize("lookup_stop", [True, False])
def test_a_cluster_drafting_by_ngram_lookup_is_exact(
    tmp_path, fixture_pair, models, lookup_stop
) -> None:
    """proposer.backend = "ngram": the receipt binds the lookup's identity (not the target's
    checkpoint it reads), sessions open, greedy text is plain decode's and sampled text the
    local lane's with the same draft. With lane.lookup_stop (the default) a decode round ends
    where the lookup proposes, so the cluster's rounds are the local lane's singleton rounds
    grouped, and its sampled text the local lane's at decode_len 1; without, a round the
    lookup declines decodes lane.decode_len tokens, and its text is the local lane's at that
    decode_len. The two texts differ (asserted), so each run tells the knob's setting."""
    from tests.cluster.conftest import make_cluster

    tok, target, _ = models
    off = "lookup_stop = false"
    edit = None if lookup_stop else (lambda text: text.replace("lookup_stop = true", off))
    cluster = make_cluster(tmp_path, fixture_pair, draft_kind="ngram", edit=edit)
    assert cluster.config.lane.lookup_stop is lookup_stop
    cluster.start()
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=128)
        for i, text in enumerate(natural_prompts(2)):
            prompt = encode(tok, text)
            target.reset()
            oracle = run_plain(target, prompt, greedy).tokens
            got = stream_generate(cluster.address, prompt, greedy)
            assert got["tokens"] == oracle, f"prompt {i}: cluster differs from plain decode"
            assert got["stats"]["drafted"] > 0
        sampled = SamplingParams(temperature=1.0, max_tokens=96, seed=7)
        prompt = encode(tok, natural_prompts(1)[0])
        lane = cluster.config.lane
        local = {}
        for decode_len in (1, lane.decode_len):
            target.reset()
            ngram = load_draft_backend("ngram", fixture_pair.target)
            width = FixedWidth(lane.draft_len, decode_len)
            run = run_local(target, ngram, prompt, sampled, q_top_k=lane.q_top_k, width=width)
            local[decode_len] = run.tokens
        assert lane.decode_len > 1 and local[1] != local[lane.decode_len]
        wanted = local[1] if lookup_stop else local[lane.decode_len]
        assert stream_generate(cluster.address, prompt, sampled)["tokens"] == wanted
    finally:
        cluster.stop()
