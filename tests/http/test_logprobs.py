"""Exact logprobs through the OpenAI API on a live cluster: every number is the target's own,
from the rows the verifier judged with, equal to plain decode's rows (the target decoding the
same tokens one at a time) within 1e-6 for every emitted token, greedy and sampled, chat and
completions, streamed and not; so a drafted token the target accepted carries the target's
value, never the draft's (the toy pair's draft accepts about half its drafts: most of these
tokens were drafted)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.cursor import KvCursor
from muser.logprobs import log_softmax64
from muser_app.fixtures import natural_prompts
from proposer_mac.openai_request import chat_prompt
from verifier_gx.backends import load_target_backend

TOLERANCE = 1e-6
K = 4
TOKENS = 24


@pytest.fixture(scope="module")
def target(fixture_pair):
    return load_target_backend("torch", fixture_pair.target)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def plain_rows(target, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Log-probability rows for `tokens` after `prompt`, the target decoding them one at a
    time as plain decode does (muser_app.lanes.plain)."""
    cursor = KvCursor(target)
    cursor.hold(prompt[:-1])
    rows = [cursor.extend([t])[-1] for t in [prompt[-1], *tokens[:-1]]]
    return log_softmax64(np.stack(rows))


def token_id(name: str) -> int:
    prefix, _, number = name.partition(":")
    assert prefix == "token_id", name
    return int(number)


def expected_top(row: np.ndarray) -> list[int]:
    return sorted(range(row.shape[0]), key=lambda t: (-row[t], t))[:K]


def check_completion(target, prompt_ids: list[int], lp) -> None:
    tokens = [token_id(t) for t in lp.tokens]
    assert len(tokens) == TOKENS
    rows = plain_rows(target, prompt_ids, tokens)
    for i, token in enumerate(tokens):
        assert abs(lp.token_logprobs[i] - rows[i][token]) <= TOLERANCE, (i, token)
        top = {token_id(t): v for t, v in lp.top_logprobs[i].items()}
        assert set(top) == set(expected_top(rows[i])) | {token}
        assert all(abs(v - rows[i][t]) <= TOLERANCE for t, v in top.items())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_are_plain_decodes_rows(
    client, model_id, tokenizer, target, temperature
):
    prompt = natural_prompts(2)[1]
    kwargs = dict(
        model=model_id, prompt=prompt, max_tokens=TOKENS, temperature=temperature, seed=5,
        logprobs=K, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    r = client.completions.create(**kwargs)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    check_completion(target, prompt_ids, r.choices[0].logprobs)
    stats = r.model_extra["muser"]
    assert stats["accepted"] > 0, "no drafted token was accepted: the test would prove less"
    streamed = list(client.completions.create(**kwargs, stream=True))
    lps = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    joined = {
        "tokens": [t for lp in lps for t in lp.tokens],
        "token_logprobs": [v for lp in lps for v in lp.token_logprobs],
    }
    assert joined["tokens"] == r.choices[0].logprobs.tokens  # each token once, in order
    assert joined["token_logprobs"] == r.choices[0].logprobs.token_logprobs


def test_chat_logprobs_are_plain_decodes_rows(client, model_id, tokenizer, target):
    messages = [{"role": "user", "content": "def parse(text):"}]
    kwargs = dict(
        model=model_id, messages=messages, max_tokens=TOKENS, temperature=1.0, seed=11,
        logprobs=True, top_logprobs=K,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    tokens = [token_id(c.token) for c in content]
    prompt = tokenizer.encode(chat_prompt(tokenizer, messages), add_special_tokens=False)
    rows = plain_rows(target, prompt, tokens)
    for i, c in enumerate(content):
        assert abs(c.logprob - rows[i][tokens[i]]) <= TOLERANCE
        assert [token_id(t.token) for t in c.top_logprobs] == expected_top(rows[i])
        assert all(abs(t.logprob - rows[i][token_id(t.token)]) <= TOLERANCE for t in c.top_logprobs)
        assert c.bytes == list(c.token.encode())
    assert len(tokens) == TOKENS


def test_a_session_that_asks_for_none_gets_none(client, model_id):
    r = client.completions.create(model=model_id, prompt="def f(", max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


@pytest.mark.asyncio
async def test_the_async_client_streams_choices_with_their_logprobs(base_url, model_id):
    """The `openai` package's async client: two seeded choices streamed, each token's
    logprobs arriving with its delta, each choice the one-choice request at seed + index."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        kwargs = dict(model=model_id, prompt="def parse(", max_tokens=8, temperature=1.0)
        stream = await client.completions.create(**kwargs, n=2, seed=21, logprobs=1, stream=True)
        texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
        for index in (0, 1):
            alone = await client.completions.create(**kwargs, seed=21 + index, logprobs=1)
            assert texts[index] == alone.choices[0].text
            assert tokens[index] == alone.choices[0].logprobs.tokens and len(tokens[index]) > 0
