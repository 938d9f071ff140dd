"""Your own models, through the HTTP API of a cluster whose daemons run in process on
loopback: pairs that share a vocabulary but not their files (a draft or a target whose
embedding is padded past the tokenizer, `vocab_size` 384 for 320 tokens, of another
architecture than its partner, its tokenizer.json re-saved in other bytes), and targets of
architectures beyond the Llama family (Gemma 2 and 3, Phi-3, OLMo 2: transformers' forward
on the verifier, an mlx-lm draft). Each time the greedy text equals the target's plain decode
token for token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

import numpy as np
import pytest

from cluster_config import load_config
from muser.sampling import SamplingParams
from muser_app.checks import check_config
from muser_app.cli.config import init_cluster
from muser_app.testing import OTHER_ARCHES, make_tiny_checkpoint, resave_tokenizer
from tests.cluster.harness import stop_in_process

PROMPT = [5, 17, 42, 9, 100, 3]
TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-pairs")
    plain = make_tiny_checkpoint(root / "llama", arch="llama", seed=1)
    padded = make_tiny_checkpoint(
        root / "qwen2-padded", arch="qwen2", vocab_size=384, tokenizer_size=320, seed=2
    )
    resave_tokenizer(padded)
    return {"llama": plain, "qwen2-padded": padded}


def complete(http: str) -> list[int]:
    body = {
        "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 0,
        "ignore_eos": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    request = urllib.request.Request(
        f"http://{http}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        choice = json.loads(reply.read())["choices"][0]
    return [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]


@contextlib.asynccontextmanager
async def cluster(tmp_path, target, draft, **init):
    """Both daemons of `config init`'s cluster on (target, draft), in this process; yields
    the proposer server (its HTTP API at `http_port`)."""
    from proposer_mac import daemon as proposer_daemon
    from verifier_gx import daemon as verifier_daemon

    path = init_cluster(tmp_path / "c", target=target, draft=draft, **init)
    config = load_config(path)
    check_config(config, receipt=False)  # every rule but the receipt: nothing refused
    verifier, _ = verifier_daemon.create_server(config, unqualified="tiny random models")
    await verifier.start()
    proposer, _ = await proposer_daemon.create_server(config)
    try:
        yield proposer
    finally:
        await stop_in_process(proposer, verifier)


def plain_decode(target) -> list[int]:
    from muser_app.lanes.plain import run_plain
    from verifier_gx.backends import load_target_backend

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    return run_plain(load_target_backend("torch", target), PROMPT, params).tokens


def drafted(proposer) -> int:
    core = proposer.core
    return core.retired.drafted + sum(r.stats.drafted for r in core.runners.values())


def accepted(proposer) -> int:
    core = proposer.core
    return core.retired.accepted + sum(r.stats.accepted for r in core.runners.values())


ARCH_LAYERS = {"gemma2": 2, "gemma3": 6, "phi3": 2, "olmo2": 2}
"""mlx-lm's Gemma 3 attends globally every sixth layer and needs that many."""


@pytest.mark.asyncio
@pytest.mark.parametrize("arch", OTHER_ARCHES)
async def test_a_target_beyond_the_llama_family_is_exact_with_an_mlx_draft(tmp_path, arch):
    """The target runs on transformers' own forward (the lean and packed ones are Llama's);
    the draft is the same checkpoint under mlx-lm, whose rows differ from torch's by
    rounding, so most drafts are accepted and the verifier still decides every token."""
    target = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=1, layers=ARCH_LAYERS[arch])
    async with cluster(tmp_path, target, target, draft_backend="mlx") as proposer:
        assert proposer.core.draft.label == "mlx"
        got = await asyncio.to_thread(complete, f"127.0.0.1:{proposer.http_port}")
        assert got == plain_decode(target) and len(got) == TOKENS
        assert accepted(proposer) > 0, "no draft accepted: the rounds emitted one token each"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("target", "draft", "defined"),
    [("llama", "qwen2-padded", 320), ("qwen2-padded", "llama", None)],  # (drafts' limit)
    ids=["padded-draft", "padded-target"],
)
async def test_a_pair_sharing_a_vocabulary_is_exact_through_the_api(
    tmp_path, checkpoints, target, draft, defined
):
    async with cluster(tmp_path, checkpoints[target], checkpoints[draft]) as proposer:
        draft_backend = proposer.core.draft
        assert draft_backend.defined_vocab == defined
        if defined is not None:  # its padding rows are never drafted
            rows = draft_backend.fork().evaluate(PROMPT)
            assert np.all(np.isneginf(rows[:, defined:])) and np.all(np.isfinite(rows[:, :defined]))
        got = await asyncio.to_thread(complete, f"127.0.0.1:{proposer.http_port}")
        assert got == plain_decode(checkpoints[target]) and len(got) == TOKENS
        if target == "qwen2-padded":  # the target emits padding ids the draft cannot embed
            assert draft_backend.unknown_id == 0  # read as the draft's end of sequence
            assert any(t >= 320 for t in got), "no padding id emitted: nothing was exercised"
        assert drafted(proposer) > 0, "no round drafted: the test would prove nothing"


def test_a_draft_reads_a_token_past_its_embedding_as_its_unknown_id():
    from muser.backend import mask_undefined
    from muser.errors import TokenOutOfVocabularyError
    from muser.geometry import check_tokens

    assert check_tokens([3, 320, 383], 320, unknown=0) == [3, 0, 0]
    with pytest.raises(TokenOutOfVocabularyError, match="token id 320 outside"):
        check_tokens([3, 320], 320)
    with pytest.raises(TokenOutOfVocabularyError, match="token id -1 outside"):
        check_tokens([-1], 320, unknown=0)  # a negative id is never a padding id
    rows = np.zeros((2, 6))
    assert mask_undefined(rows, 4) is rows
    assert np.isneginf(rows[:, 4:]).all() and (rows[:, :4] == 0).all()
    assert np.array_equal(mask_undefined(np.ones((1, 3)), None), np.ones((1, 3)))
