"""The local tree lane (muser_app.lanes.tree) on the toy fixture pair: greedy trees emit the
target's plain decode token for token, a seed gives the same sampled text twice, wider trees
emit more tokens per target call than the one-branch tree, and bad shapes are refused."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from muser.sampling import SamplingParams
from muser.tree_width import shape_nodes
from muser_app.fixtures import build_fixtures, natural_prompts
from muser_app.lanes.plain import run_plain
from muser_app.lanes.tree import parse_branching, run_local_tree
from proposer_mac.backends import load_draft_backend
from verifier_gx.backends import load_target_backend


@pytest.fixture(scope="module")
def natural():
    pair = build_fixtures(progress=False).natural
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    return tok, load_target_backend("torch", pair.target), load_draft_backend("torch", pair.draft)


def prompts(tok, n):
    return [list(tok.encode(t, add_special_tokens=False)) for t in natural_prompts(n)]


@pytest.mark.parametrize("branching", [[1, 1, 1, 1], [3, 2, 1], [4, 2, 2, 1]])
def test_a_greedy_tree_lane_equals_plain_decode(natural, branching):
    tok, target, draft = natural
    params = SamplingParams(temperature=0.0, max_tokens=128)
    for i, prompt in enumerate(prompts(tok, 4)):
        target.reset()
        oracle = run_plain(target, prompt, params)
        got = run_local_tree(target, draft, prompt, params, branching=branching)
        assert got.tokens == oracle.tokens, f"prompt {i}, tree {branching}: differs from plain"
        assert len(got.tokens) == 128


@pytest.mark.parametrize("branching", [[4, 1, 1, 1], [3, 2, 2]])
def test_a_greedy_lookup_tree_lane_equals_plain_decode(natural, branching):
    """The n-gram draft drafts trees of its lookup candidates (no forward); greedy text is
    plain decode's and rounds still draft."""
    from proposer_mac.backends.ngram import NgramDraft

    tok, target, _ = natural
    params = SamplingParams(temperature=0.0, max_tokens=96)
    draft = NgramDraft(build_fixtures(progress=False).natural.target)
    nodes = 0
    for i, prompt in enumerate(prompts(tok, 4)):
        target.reset()
        oracle = run_plain(target, prompt, params)
        got = run_local_tree(target, draft, prompt, params, branching=branching)
        assert got.tokens == oracle.tokens, f"prompt {i}, tree {branching}: differs from plain"
        nodes += got.stats.tree_nodes
    assert nodes > 0


def test_a_sampled_tree_lane_gives_the_same_tokens_for_the_same_seed(natural):
    tok, target, draft = natural
    params = SamplingParams(temperature=1.0, max_tokens=96, seed=31)
    prompt = prompts(tok, 1)[0]
    runs = [run_local_tree(target, draft, prompt, params, branching=[3, 2, 1]) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 96
    other = run_local_tree(
        target, draft, prompt, SamplingParams(temperature=1.0, max_tokens=96, seed=32),
        branching=[3, 2, 1],
    )  # fmt: skip
    assert other.tokens != runs[0].tokens


def test_wider_trees_emit_more_tokens_per_target_call(natural):
    tok, target, draft = natural
    params = SamplingParams(temperature=0.0, max_tokens=128)
    per_call = {}
    for shape in ([1, 1, 1], [4, 2, 1]):
        emitted = calls = 0
        for prompt in prompts(tok, 4):
            stats = run_local_tree(target, draft, prompt, params, branching=shape).stats
            emitted, calls = emitted + stats.emitted, calls + stats.rounds
        per_call[tuple(shape)] = emitted / calls
    assert per_call[(4, 2, 1)] > per_call[(1, 1, 1)], per_call


def test_a_shape_is_children_per_depth():
    assert parse_branching("3,2,1") == [3, 2, 1]
    assert shape_nodes([3, 2, 1]) == 3 + 6 + 6
    for bad in ("", "3,0", "a,b", "-1"):
        with pytest.raises(ValueError, match="children per depth"):
            parse_branching(bad)
