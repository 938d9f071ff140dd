"""What the API says about its model and itself, as `vllm serve` says it: /v1/models with the
served names, /tokenize, /detokenize, /version, /health; and a request's choices (prompts
times n), each its own session. On the app with a stand-in core (tests/http/
test_http_failures.py's): no daemons, the fixture tokenizer."""

from __future__ import annotations

import types

import grpc
import pytest

from muser import __version__
from muser.sampling import SamplingParams
from proposer_mac.openai_request import ChatForm, chat_prompt
from tests.http.test_http_failures import Core, client_of, events

KEY = "k" * 24


@pytest.fixture
def ids(tokenizer) -> list[int]:
    return list(tokenizer.encode(" hello world. foo bar", add_special_tokens=False))


class Serving:
    """A health that answers SERVING, and a pool of `members` (name, channel)."""

    def __init__(self, members=(), faults=None):
        self.health = types.SimpleNamespace(serving=not faults, faults=faults or {})
        self.pool = types.SimpleNamespace(
            members={m.name: m for m in members}, order=[m.name for m in members]
        )


@pytest.mark.asyncio
async def test_models_lists_a_card_per_served_name_and_answers_to_each(tokenizer, ids):
    core = Core([ids[:2]])
    client = await client_of(core, tokenizer, served_model_name=("smol", "smol-chat"))
    try:
        cards = (await (await client.get("/v1/models")).json())["data"]
        ok = await client.post("/v1/completions", json={"model": "smol-chat", "prompt": "x"})
        reply = await ok.json()
        missing = await client.post("/v1/completions", json={"model": "target", "prompt": "x"})
        error = (await missing.json())["error"]
    finally:
        await client.close()
    assert [c["id"] for c in cards] == ["smol", "smol-chat"]
    assert all(c["max_model_len"] == 2048 and c["object"] == "model" for c in cards)
    assert ok.status == 200 and reply["model"] == "smol"  # responses carry the first name
    assert missing.status == 404 and error["code"] == "model_not_found"
    assert "The model `target` does not exist" in error["message"] and "'smol'" in error["message"]


@pytest.mark.asyncio
async def test_tokenize_and_detokenize_round_trip(tokenizer):
    client = await client_of(Core(), tokenizer)
    text = " hello world. foo bar"
    try:
        tok = await (await client.post("/tokenize", json={"prompt": text})).json()
        strs = await client.post("/tokenize", json={"prompt": text, "return_token_strs": True})
        strs = await strs.json()
        back = await (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
        messages = [{"role": "user", "content": "hi"}]
        chat = await (await client.post("/tokenize", json={"messages": messages})).json()
    finally:
        await client.close()
    assert tok["tokens"] == tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 2048 and tok["token_strs"] is None
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(tok["tokens"])
    assert back == {"prompt": text}
    rendered = chat_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens", "defines ids 0..2047"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "greater than or equal to 0"),
        ("/detokenize", {}, 400, "tokens", "Field required"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "valid string"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
         "tools", "not supported"),
    ],
)  # fmt: skip
@pytest.mark.asyncio
async def test_bad_tokenize_requests_name_the_field(tokenizer, path, body, status, param, message):
    client = await client_of(Core(), tokenizer)
    try:
        r = await client.post(path, json=body)
        error = (await r.json())["error"]
    finally:
        await client.close()
    assert r.status == status and error["param"] == param and message in error["message"]


@pytest.mark.asyncio
async def test_version_and_health_answer_without_a_key_and_the_rest_does_not(tokenizer):
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens on port 1
    member = types.SimpleNamespace(name="gx", address="127.0.0.1:1", channel=channel)
    core = Core()
    core.__dict__.update(vars(Serving([member])))
    client = await client_of(core, tokenizer, api_keys=(KEY,))
    try:
        version = await client.get("/version")
        answer = await version.json()
        health = await client.get("/health")
        why = (await health.json())["error"]["message"]
        tokenize = await client.post("/tokenize", json={"prompt": "x"})
    finally:
        await client.close()
        await channel.close()
    assert version.status == 200 and answer == {"version": __version__}
    assert health.status == 503 and "verifier gx at 127.0.0.1:1 did not answer" in why
    assert tokenize.status == 401


@pytest.mark.asyncio
async def test_health_is_503_naming_the_proposers_own_fault(tokenizer):
    core = Core()
    core.__dict__.update(vars(Serving(faults={"wal": "fsync failed: disk full"})))
    client = await client_of(core, tokenizer)
    try:
        r = await client.get("/health")
        why = (await r.json())["error"]["message"]
    finally:
        await client.close()
    assert r.status == 503 and "NOT_SERVING (wal: fsync failed: disk full)" in why


@pytest.mark.asyncio
async def test_each_choice_is_a_session_with_the_seed_plus_its_index(tokenizer, ids):
    core = Core([ids[:3]])
    client = await client_of(core, tokenizer)
    body = {"prompt": [[9, 5, 6], [5, 6]], "n": 2, "seed": 7, "temperature": 1, "max_tokens": 3}
    try:
        r = await client.post("/v1/completions", json=body)
        reply = await r.json()
    finally:
        await client.close()
    assert r.status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert [run.session.params.seed for run in core.runners] == [7, 8, 7, 8]
    prompts = [run.session.prompt for run in core.runners]
    assert prompts == [[9, 5, 6], [9, 5, 6], [5, 6], [5, 6]]
    assert all(c["text"] == tokenizer.decode(ids[:3]) for c in reply["choices"])
    assert reply["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert all(run.cancelled for run in core.runners)


@pytest.mark.asyncio
async def test_a_streamed_choice_keeps_its_index_and_its_own_text(tokenizer, ids):
    core = Core([ids[:2], ids[2:4]])
    client = await client_of(core, tokenizer)
    try:
        r = await client.post("/v1/completions", json={"prompt": "x", "n": 3, "stream": True})
        chunks = events(await r.read())
    finally:
        await client.close()
    texts = {i: "" for i in range(3)}
    reasons = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    assert chunks[-1] == "[DONE]"
    assert texts == {i: tokenizer.decode(ids[:4]) for i in range(3)}
    assert set(reasons) == {0, 1, 2}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": "x", "n": 5}, "n", "n 5 asks for 5 choices; this server gives at most 4"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "n", "3 prompts x n 2 asks for 6 choices"),
        ({"prompt": ["a", ""]}, "prompt[1]", "non-empty"),
    ],
)
@pytest.mark.asyncio
async def test_choices_beyond_the_bound_start_nothing(tokenizer, body, param, message):
    core = Core()
    client = await client_of(core, tokenizer, max_n=4)
    try:
        r = await client.post("/v1/completions", json=body)
        error = (await r.json())["error"]
    finally:
        await client.close()
    assert r.status == 400 and error["param"] == param and message in error["message"], error
    assert core.runners == []


@pytest.mark.asyncio
async def test_stop_token_ids_echo_and_stop_strings_shape_the_text(tokenizer, ids):
    eos = tokenizer.eos_token_id
    stop_id = ids[2]
    core = Core([ids[:3]])
    client = await client_of(core, tokenizer)
    stop_text = tokenizer.decode(ids[1:2])
    try:
        by_id = await client.post(
            "/v1/completions", json={"prompt": "q", "stop_token_ids": [stop_id], "echo": True}
        )
        by_id = (await by_id.json())["choices"][0]
        kept = await client.post(
            "/v1/completions",
            json={"prompt": "q", "stop": stop_text.strip(), "include_stop_str_in_output": True},
        )
        kept = (await kept.json())["choices"][0]
    finally:
        await client.close()
    params: SamplingParams = core.runners[0].session.params
    assert params.stop_tokens == (eos, stop_id)
    assert by_id["text"] == "q" + tokenizer.decode(ids[:3])
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == stop_id
    text = tokenizer.decode(ids[:3])
    cut = text.index(stop_text.strip()) + len(stop_text.strip())
    assert kept["text"] == text[:cut] and kept["stop_reason"] == stop_text.strip()


@pytest.mark.asyncio
async def test_special_tokens_are_spelled_only_when_asked(tokenizer, ids):
    eos = tokenizer.eos_token_id
    core = Core([[*ids[:2], eos]])
    client = await client_of(core, tokenizer)
    try:
        plain = await client.post("/v1/completions", json={"prompt": "q"})
        spelled = await client.post(
            "/v1/completions", json={"prompt": "q", "skip_special_tokens": False}
        )
        plain, spelled = (await plain.json())["choices"][0], (await spelled.json())["choices"][0]
    finally:
        await client.close()
    assert plain["text"] == tokenizer.decode(ids[:2])
    assert spelled["text"] == tokenizer.decode(ids[:2]) + tokenizer.eos_token
    assert plain["finish_reason"] == "stop" and plain["stop_reason"] is None


def test_a_chat_template_hears_the_request_and_its_kwargs(tokenizer):
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or not "
        "continue_final_message %}</{{ m.role }}>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{% if think %}[think]{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    tokenizer.chat_template, before = template, tokenizer.chat_template
    try:
        default = chat_prompt(tokenizer, messages[:1])
        thinking = chat_prompt(tokenizer, messages[:1], ChatForm(template_kwargs={"think": True}))
        cont = chat_prompt(tokenizer, messages, ChatForm(False, True))
    finally:
        tokenizer.chat_template = before
    assert default == "<user>hi</user><assistant>"
    assert thinking == "<user>hi</user><assistant>[think]"
    assert cont == "<user>hi</user><assistant>Sure"


def test_a_template_kwarg_may_not_stand_in_for_a_request_field(tokenizer):
    from proposer_mac.openai_request import ApiError

    tokenizer.chat_template, before = "{{ messages }}", tokenizer.chat_template
    try:
        with pytest.raises(ApiError, match="chat_template_kwargs may not set 'tokenize'"):
            chat_prompt(
                tokenizer, [{"role": "u", "content": "x"}], ChatForm(True, False, {"tokenize": 1})
            )
    finally:
        tokenizer.chat_template = before


def test_the_fixtures_plain_chat_prompt_continues_or_cues():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    assert chat_prompt(object(), messages[:1]) == "User: hi\nAssistant:"
    assert chat_prompt(object(), messages[:1], ChatForm(False)) == "User: hi\n"
    assert chat_prompt(object(), messages, ChatForm(False, True)) == "User: hi\nAssistant: Sure"
