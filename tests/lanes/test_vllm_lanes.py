"""Greedy output with vLLM verifying equals torch's plain decode on the natural fixtures
(marker `vllm`: runs in .venv-vllm, `make test-vllm`)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

from muser.sampling import SamplingParams
from muser_app.fixtures import build_fixtures, natural_prompts
from muser_app.lanes.local import run_local
from muser_app.lanes.plain import run_plain
from proposer_mac.backends import load_draft_backend
from verifier_gx.backends import load_target_backend

pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(temperature=0.0, max_tokens=256)


@pytest.fixture(scope="module")
def natural():
    pair = build_fixtures(progress=False).natural
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    torch_target = load_target_backend("torch", pair.target)
    vllm_target = load_target_backend("vllm", pair.target)
    return tok, torch_target, vllm_target, load_draft_backend("torch", pair.draft)


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def probs(row: np.ndarray) -> np.ndarray:
    e = np.exp(row - row.max())
    return e / e.sum()


def vllm_trees(text: str) -> str:
    """A cluster file's edit: the verifier on vLLM, 16-node trees of one shape."""
    text = text.replace('backend = "torch"', 'backend = "vllm"', 1)
    text = text.replace("tree_nodes = 0", "tree_nodes = 16")
    return text.replace('width = "adaptive"', 'width = "fixed"')


def generate_on(cluster, prompts, oracles, params: SamplingParams, what: str) -> list[dict]:
    """Start `cluster`, generate each prompt and hold its tokens to its oracle; each one's
    stats."""
    from muser_app.cli.cluster_client import stream_generate

    cluster.start()
    try:
        out = []
        for i, (prompt, oracle) in enumerate(zip(prompts, oracles, strict=True)):
            got = stream_generate(cluster.address, prompt, params)
            assert got["tokens"] == oracle, f"prompt {i}: {what} differs"
            out.append(got["stats"])
        return out
    finally:
        cluster.stop()


def plain_of(tok, torch_target, params: SamplingParams, n: int, skip: int = 0):
    """Natural prompts `skip` to `skip + n`, their ids and torch's plain decode of each."""
    prompts = [encode(tok, text) for text in natural_prompts(skip + n)[skip:]]
    oracles = []
    for prompt in prompts:
        torch_target.reset()
        oracles.append(run_plain(torch_target, prompt, params).tokens)
    return prompts, oracles


def test_greedy_plain_decode_on_vllm_equals_torch(natural) -> None:
    """3 prompts x 256 tokens: identical tokens, every witness row within 1e-4."""
    tok, torch_target, vllm_target, _ = natural
    for i, text in enumerate(natural_prompts(3)):
        prompt = encode(tok, text)
        torch_target.reset()
        vllm_target.reset()
        oracle = run_plain(torch_target, prompt, GREEDY, record_rows=True)
        got = run_plain(vllm_target, prompt, GREEDY, record_rows=True)
        assert got.tokens == oracle.tokens, f"prompt {i}: vllm plain decode differs from torch"
        assert len(got.tokens) == 256 and got.rows.keys() == oracle.rows.keys()
        worst = max(np.abs(probs(got.rows[k]) - probs(oracle.rows[k])).max() for k in oracle.rows)
        assert worst <= 1e-4, f"prompt {i}: a witness row differs by {worst:.2e}"


def test_greedy_local_lane_on_vllm_equals_torch_plain(natural) -> None:
    """The speculative lane with vLLM verifying: 3 prompts x 256 tokens equal the oracle,
    and no round re-evaluated the context."""
    tok, torch_target, vllm_target, draft = natural
    for i, text in enumerate(natural_prompts(6)[3:]):
        prompt = encode(tok, text)
        torch_target.reset()
        oracle = run_plain(torch_target, prompt, GREEDY)
        vllm_target.reset()
        draft.reset()
        recomputes = vllm_target.full_recomputes
        local = run_local(vllm_target, draft, prompt, GREEDY, draft_len=4)
        assert local.tokens == oracle.tokens, f"prompt {i}: local lane on vllm differs"
        assert len(local.tokens) == 256
        assert vllm_target.full_recomputes == recomputes


def test_generate_cli_on_vllm_prints_clean_json_equal_to_torch(natural) -> None:
    """Regression: vLLM logs to stdout by default, which broke `muser generate --json`."""
    from muser_app.cli._common import encode_prompt

    tok, torch_target, _, _ = natural
    text = natural_prompts(1)[0]
    out = subprocess.run(
        [sys.executable, "-m", "muser_app.cli.main", "generate", "--lane", "plain"]
        + ["--target-backend", "vllm", "--prompt", text, "--max-tokens", "64", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)["tokens"]
    torch_target.reset()
    params = SamplingParams(temperature=0.0, max_tokens=64)
    assert got == run_plain(torch_target, encode_prompt(tok, text), params).tokens


def test_greedy_cluster_with_a_vllm_verifier_equals_torch_plain(natural, tmp_path) -> None:
    """Real daemons on loopback, the verifier's target under vLLM (qualified for real on that
    backend): 3 prompts x 128 greedy tokens equal torch's plain decode."""
    from muser_app.cli.cluster_client import stream_generate
    from tests.cluster.conftest import make_cluster

    tok, torch_target, _, _ = natural
    pair = build_fixtures(progress=False).natural
    cluster = make_cluster(
        tmp_path,
        pair,
        edit=lambda text: text.replace('backend = "torch"', 'backend = "vllm"', 1),
    )
    assert cluster.config.verifier.backend == "vllm"
    params = SamplingParams(temperature=0.0, max_tokens=128)
    cluster.start()
    try:
        for i, text in enumerate(natural_prompts(3)):
            prompt = encode(tok, text)
            torch_target.reset()
            oracle = run_plain(torch_target, prompt, params).tokens
            got = stream_generate(cluster.address, prompt, params)["tokens"]
            assert got == oracle, f"prompt {i}: the vLLM-verified cluster differs from plain"
    finally:
        cluster.stop()


def test_the_conditioned_draft_on_a_vllm_target_equals_torch_plain(natural, tmp_path) -> None:
    """issue 32: the capture stream from a vLLM target. The local lane reads the rows
    through the target's `evaluate_capture`; a two-daemon cluster with the verifier under
    vLLM sends them with each signed result. 3 prompts x 64 greedy tokens equal torch's plain
    decode in both, and the draft drafts from the rows (it accepts)."""
    from muser_app.fixtures import FixturePair
    from muser_app.pairs import pair_conditioned_draft
    from tests.cluster.conftest import make_cluster

    tok, torch_target, vllm_target, _ = natural
    pair = build_fixtures(progress=False).natural
    draft_dir = pair_conditioned_draft("toy", progress=False)
    draft = load_draft_backend("conditioned", draft_dir)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompts, oracles = plain_of(tok, torch_target, params, 3)
    accepted = 0
    for i, (prompt, oracle) in enumerate(zip(prompts, oracles, strict=True)):
        vllm_target.reset()
        local = run_local(vllm_target, draft, prompt, params, draft_len=4)
        assert local.tokens == oracle, f"prompt {i}: the conditioned local lane on vllm differs"
        accepted += local.stats.accepted
    assert accepted > 3 * 64 // 4
    cluster = make_cluster(
        tmp_path,
        FixturePair(pair.target, draft_dir),
        edit=lambda text: text.replace('backend = "torch"', 'backend = "vllm"', 1),
    )
    assert cluster.config.verifier.backend == "vllm"
    assert cluster.config.proposer.backend == "conditioned"
    for stats in generate_on(cluster, prompts, oracles, params, "the vLLM-verified cluster"):
        assert stats["capture"]["bytes"] > 0 and stats["accepted"] > 0


def test_a_tree_cluster_with_a_vllm_verifier_equals_torch_plain(natural, tmp_path) -> None:
    """issue 33: tree rounds judged on a vLLM target (a request per branch over the prefix
    cache), in the local tree lane and in a cluster whose verifier offers tree rounds at
    open: 16-node trees, 3 prompts x 64 greedy tokens equal torch's plain decode in both."""
    from muser_app.cli.cluster_client import stream_generate
    from muser_app.lanes.tree import run_local_tree
    from tests.cluster.conftest import make_cluster

    tok, torch_target, vllm_target, draft = natural
    pair = build_fixtures(progress=False).natural
    params = SamplingParams(temperature=0.0, max_tokens=64)
    # prompts no other test of this module generates from: a tree path whose full block the
    # engine cached for an earlier request has no rows of its own in the step, and goes
    # again with the cache off (docs/backends.md, limits)
    prompts, oracles = plain_of(tok, torch_target, params, 3, skip=9)
    recomputes = vllm_target.full_recomputes
    for i, (prompt, oracle) in enumerate(zip(prompts, oracles, strict=True)):
        draft.reset()
        local = run_local_tree(vllm_target, draft, prompt, params, branching=[4, 1, 1, 1])
        assert local.tokens == oracle, f"prompt {i}: the local tree lane on vllm differs"
        assert local.stats.tree_nodes > local.stats.drafted
    assert vllm_target.full_recomputes == recomputes

    cluster = make_cluster(tmp_path, pair, edit=vllm_trees)
    assert cluster.config.verifier.backend == "vllm" and cluster.config.lane.tree_nodes == 16
    cluster.start()
    try:
        for i, (prompt, oracle) in enumerate(zip(prompts, oracles, strict=True)):
            got = stream_generate(cluster.address, prompt, params)
            assert got["tokens"] == oracle, f"prompt {i}: the vLLM tree cluster differs"
            tree = got["stats"]["tree"]
            assert tree["shape"] == [4, 4, 4, 4] and tree["nodes"] > got["stats"]["drafted"]
    finally:
        cluster.stop()


def test_the_conditioned_draft_drafts_trees_on_a_vllm_target(natural, tmp_path) -> None:
    """issues 32 x 33: a capturing session's trees on vLLM. The conditioned draft drafts
    16-node trees; the target keeps every entry's capture rows from the tree's requests and
    the draft reads the root's and the accepted path's. The local tree lane and a cluster
    whose vLLM verifier offers `capture-trees` emit torch's plain decode, 2 prompts x 64
    greedy tokens."""
    from muser_app.fixtures import FixturePair
    from muser_app.lanes.tree import run_local_tree
    from muser_app.pairs import pair_conditioned_draft
    from tests.cluster.conftest import make_cluster

    tok, torch_target, vllm_target, _ = natural
    pair = build_fixtures(progress=False).natural
    draft_dir = pair_conditioned_draft("toy", progress=False)
    draft = load_draft_backend("conditioned", draft_dir)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompts, oracles = plain_of(tok, torch_target, params, 2, skip=12)
    for i, (prompt, oracle) in enumerate(zip(prompts, oracles, strict=True)):
        local = run_local_tree(vllm_target, draft, prompt, params, branching=[4, 1, 1, 1])
        assert local.tokens == oracle, f"prompt {i}: the conditioned tree lane on vllm differs"
        assert local.stats.tree_nodes > local.stats.drafted > 0

    cluster = make_cluster(tmp_path, FixturePair(pair.target, draft_dir), edit=vllm_trees)
    assert cluster.config.proposer.backend == "conditioned"
    for stats in generate_on(cluster, prompts, oracles, params, "the conditioned tree cluster"):
        assert stats["tree"]["nodes"] > stats["drafted"] > 0
        assert stats["capture"]["bytes"] > 0


def test_vllm_speculative_peer_equals_torch_plain(natural) -> None:
    """The bench's vLLM peer (vLLM's own draft-model speculative decoding, D = 4, in a child
    process): 3 prompts x 256 greedy tokens equal torch's plain decode, and it did speculate."""
    from pathlib import Path

    from muser_app.bench.lanes import vllm_speculative_lane

    tok, torch_target, _, _ = natural
    pair = build_fixtures(progress=False).natural
    peer, note = vllm_speculative_lane(Path(sys.executable), pair.target, pair.draft, 4)
    assert peer is not None, note
    try:
        assert note.startswith("ran in a child process"), note
        for i, text in enumerate(natural_prompts(3)):
            prompt = encode(tok, text)
            torch_target.reset()
            oracle = run_plain(torch_target, prompt, GREEDY).tokens
            got = peer(prompt, 256)
            assert got.tokens == oracle, f"prompt {i}: vLLM speculative decoding differs"
            assert got.rounds > 0 and 0 < got.accepted <= got.drafted == 4 * got.rounds
    finally:
        peer.close()
