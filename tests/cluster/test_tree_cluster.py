"""Token trees in a real two-daemon cluster (issue 33): lane.tree_nodes in the cluster file,
the proposer drafts each round as a tree (`Drafter.tree_steps`), the verifier judges every
branch in one target call. Greedy text equals plain decode, qualification ran the tree lane,
the stats report the shape, and SIGKILL of either daemon loses and repeats no token."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from muser.sampling import SamplingParams
from muser_app.cli.cluster_client import stream_generate
from muser_app.fixtures import natural_prompts
from muser_app.lanes.plain import run_plain
from tests.cluster.conftest import make_cluster
from verifier_gx.backends import load_target_backend

NODES = 16
SHAPE = [4, 4, 4, 4]  # nodes per depth of muser.tree_width.shape_for_budget(16, 4): 4,1,1,1


def with_trees(width: str):
    def edit(text: str) -> str:
        text = text.replace("tree_nodes = 0", f"tree_nodes = {NODES}")
        return text.replace('width = "adaptive"', f'width = "{width}"')

    return edit


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, fixture_pair):
    """Trees of one shape (lane.width "fixed"): a seed then pins the sampled text. One
    cluster for the module: the kill tests restart its daemons, as a crash would."""
    c = make_cluster(tmp_path_factory.mktemp("trees"), fixture_pair, edit=with_trees("fixed"))
    c.start()
    yield c
    c.stop()


def prompt_of(cluster, i: int) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(cluster.config.verifier.target))
    return list(tok.encode(natural_prompts(4)[i], add_special_tokens=False))


def oracle(cluster, prompt, params) -> list[int]:
    target = load_target_backend("torch", cluster.config.verifier.target)
    return run_plain(target, prompt, params).tokens


def test_greedy_tree_cluster_equals_plain_decode(cluster) -> None:
    assert cluster.config.lane.tree_nodes == NODES
    assert '"tree_nodes": 16' in cluster.config.lane.receipt.read_text()  # qualified as trees
    params = SamplingParams(temperature=0.0, max_tokens=64)
    rounds = emitted = hits = followed = sent = guesses = 0
    for i in range(4):
        prompt = prompt_of(cluster, i)
        got = stream_generate(cluster.address, prompt, params)
        assert got["tokens"] == oracle(cluster, prompt, params), f"prompt {i}"
        stats = got["stats"]
        assert stats["tree"]["shape"] == SHAPE
        assert stats["tree"]["nodes"] > stats["drafted"]  # wider than the chain of its depth
        rounds, emitted = rounds + stats["rounds"], emitted + len(got["tokens"])
        hits += stats["speculation"]["hits"]
        followed += stats["speculation"]["on_decision"]
        guesses += stats["speculation"]["guess_hits"]
        sent += stats["speculation"]["sent_ahead"]
        assert stats["speculation"]["ahead_void"] == 0  # each decision predicted its head
    assert emitted / rounds > 1.5  # the toy pair's trees emit ~3 a round (docs/trees.md)
    assert hits > followed > 0  # trees drafted ahead were used: on the guess, on the decision
    assert guesses == hits - followed  # (one shape: every tree drafted on a decision is used)
    assert sent > 0  # and the next tree went out on the decision


def a_seed_repeats(cluster, tokens: int = 32, seed: int = 2) -> None:
    """Prompt 1 sampled twice with one seed: the same text, as long as asked."""
    params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=seed)
    first = stream_generate(cluster.address, prompt_of(cluster, 1), params)
    second = stream_generate(cluster.address, prompt_of(cluster, 1), params)
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == tokens


def test_sampled_tree_cluster_repeats_for_a_seed(cluster) -> None:
    a_seed_repeats(cluster, 48, 5)


@pytest.mark.parametrize("victim", ["proposer", "verifier"])
def test_sigkill_mid_tree_generation_loses_no_token(cluster, victim) -> None:
    from tests.cluster.test_crash import crash_run

    prompt = prompt_of(cluster, 2)
    params = SamplingParams(temperature=0.0, max_tokens=96)
    result, kills = crash_run(cluster, prompt, victim, points=2, seed=11, params=params)
    assert kills == 2
    assert result["tokens"] == oracle(cluster, prompt, params)
    assert result["stats"]["tree"]["nodes"] > 0


def test_an_adaptive_tree_lane_learns_shapes_and_stays_exact(tmp_path, fixture_pair) -> None:
    """lane.width "adaptive" with lane.tree_nodes: each session learns among shapes from its
    results and round times (muser.tree_width); greedy text is plain decode's whatever the
    shapes."""
    cluster = make_cluster(tmp_path, fixture_pair, edit=with_trees("adaptive"))
    cluster.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        prompt = prompt_of(cluster, 3)
        got = stream_generate(cluster.address, prompt, params)
        assert got["tokens"] == oracle(cluster, prompt, params)
        policy = got["stats"]["tree"]["policy"]
        assert policy["mode"] == "adaptive" and policy["budget"] == NODES
        assert len(policy["round_ms"]) >= 3  # it tried the candidates: no draft, chain, trees
    finally:
        cluster.stop()


def test_prompt_lookup_drafts_trees_in_the_cluster(tmp_path, fixture_pair) -> None:
    """proposer.backend "ngram" with lane.tree_nodes: each round a tree of the lookup's
    candidates (`NgramDraft.candidates`), qualified as trees; greedy text is plain decode's
    and a seed repeats its sampled text."""
    cluster = make_cluster(tmp_path, fixture_pair, edit=with_trees("fixed"), draft_kind="ngram")
    assert cluster.config.proposer.backend == "ngram" and cluster.config.lane.tree_nodes == NODES
    cluster.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        nodes = 0
        for i in (0, 3):
            prompt = prompt_of(cluster, i)
            got = stream_generate(cluster.address, prompt, params)
            assert got["tokens"] == oracle(cluster, prompt, params), f"prompt {i}"
            nodes += got["stats"]["tree"]["nodes"]
        assert nodes > 0
        a_seed_repeats(cluster)
    finally:
        cluster.stop()


def test_the_conditioned_draft_drafts_trees_in_the_cluster(tmp_path, fixture_pair) -> None:
    """proposer.backend "conditioned" with lane.tree_nodes: the draft drafts each round's
    tree from the target's rows (each node reading its parent's output), the verifier keeps
    the rows of the root and the accepted path in the tree's forward and sends them with the
    result; qualified as trees; greedy text is plain decode's and a seed repeats its sampled
    text."""
    from muser_app.fixtures import FixturePair
    from muser_app.pairs import pair_conditioned_draft

    pair = FixturePair(fixture_pair.target, pair_conditioned_draft("toy", progress=False))
    cluster = make_cluster(tmp_path, pair, edit=with_trees("fixed"))
    assert cluster.config.proposer.backend == "conditioned"
    assert '"tree_nodes": 16' in cluster.config.lane.receipt.read_text()
    cluster.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        rounds = emitted = 0
        for i in (0, 3):
            prompt = prompt_of(cluster, i)
            got = stream_generate(cluster.address, prompt, params)
            assert got["tokens"] == oracle(cluster, prompt, params), f"prompt {i}"
            stats = got["stats"]
            assert stats["tree"]["nodes"] > stats["drafted"] > 0  # trees, drafted from rows
            assert stats["capture"]["bytes"] > 0
            assert stats["speculation"]["ahead_void"] == 0
            rounds, emitted = rounds + stats["rounds"], emitted + len(got["tokens"])
        assert emitted / rounds > 2.0  # measured 3.4 on the local tree lane (docs/trees.md)
        a_seed_repeats(cluster)
    finally:
        cluster.stop()
