"""The HTTP API's failure paths on a stand-in core (no cluster): sessions that fail after the
status line or after they started, fields the server would ignore, oversized bodies, and
clients that leave a non-streaming request."""

from __future__ import annotations

import asyncio
import json
import types

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from muser.errors import RefusedError
from proposer_mac import http_api
from proposer_mac.link import LinkDown, RoundRefused
from proposer_mac.session import ResultRejected

pytestmark = pytest.mark.asyncio

WAIT_S = 10
"""The longest any read here may take: a response that never ends fails the test."""


class Stats:
    rounds = drafted = accepted = 0
    acceptance = tokens_per_round = 0.0


class Runner:
    """A SessionRunner stand-in: `script` is the durable tokens, one list per wait; then
    `error` is raised (or the session is done)."""

    def __init__(self, prompt, params, script, error=None, delay=0.0):
        self.session = types.SimpleNamespace(
            session_id=bytes(range(16)), emitted=[], params=params, prompt=prompt
        )
        self.stats = Stats()
        self.script, self.error, self.delay = list(script), error, delay
        self.cancelled, self.waits = False, 0

    async def wait_tokens(self, offset):
        self.waits += 1
        await asyncio.sleep(self.delay)
        if not self.script:
            if self.error is not None:
                raise self.error
            return [], True
        chunk = self.script.pop(0)
        self.session.emitted += chunk
        return chunk, not self.script and self.error is None

    def cancel(self):
        self.cancelled = True


class Core:
    """A ProposerCore stand-in: each session runs `script`; `refuse` fails the start."""

    def __init__(self, script=(), error=None, delay=0.0, refuse=None, runner=Runner):
        self.script, self.error, self.delay, self.refuse = script, error, delay, refuse
        self.runner = runner
        self.target_identity = types.SimpleNamespace(
            model_digest="ab" * 32, tokenizer_digest="cd", vocab_size=2048
        )
        self.draft_identity = types.SimpleNamespace(model_digest="ef")
        self.runners: list[Runner] = []

    async def start_session(self, prompt, params, *, detached=False):
        assert detached  # an HTTP client cannot reconnect: a restart must end its session
        if self.refuse is not None:
            raise self.refuse
        self.runners.append(self.runner(prompt, params, self.script, self.error, self.delay))
        return self.runners[-1]


def config(
    max_message_bytes: int = 1 << 20,
    api_keys: tuple[str, ...] = (),
    served_model_name: tuple[str, ...] = (),
    max_n: int = 16,
):
    limits = types.SimpleNamespace(max_message_bytes=max_message_bytes, max_tokens=4096)
    return types.SimpleNamespace(
        limits=limits,
        verifier=types.SimpleNamespace(target="/x/t"),
        http=types.SimpleNamespace(
            secrets=lambda: list(api_keys),
            served_model_name=list(served_model_name),
            max_n=max_n,
        ),
    )


def app_of(core, tokenizer, **cfg):
    return http_api.create_app(
        core, config(**cfg), tokenizer, model_id="target", context_length=2048
    )


async def client_of(core, tokenizer, **cfg) -> TestClient:
    client = TestClient(TestServer(app_of(core, tokenizer, **cfg)))
    await client.start_server()
    return client


def events(body: bytes) -> list:
    """The server-sent events of a body: JSON objects, and "[DONE]"."""
    out = []
    for block in body.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), body
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture
def ids(tokenizer) -> list[int]:
    return list(tokenizer.encode(" hello world. foo bar", add_special_tokens=False))


# --- a session that fails after the status line: the error is the last event --------------


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RuntimeError("disk full"), 500),
        (OSError(28, "No space left on device"), 500),
        (ResultRejected("result head does not chain"), 502),
        (RoundRefused(grpc.StatusCode.ABORTED, "head_mismatch", "head"), 502),
        (LinkDown("no answer from the verifier"), 503),
    ],
    ids=["runtime", "oserror", "rejected", "refused", "linkdown"],
)
async def test_a_session_failing_mid_stream_ends_with_an_error_event_and_done(
    tokenizer, ids, error, status
):
    core = Core([ids[:3], ids[3:6]], error=error)
    client = await client_of(core, tokenizer)
    try:
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 50}
        )
        assert r.status == 200
        got = events(await asyncio.wait_for(r.read(), WAIT_S))
    finally:
        await client.close()
    *chunks, failure, done = got
    assert done == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(ids[:6])
    assert failure["error"]["type"] == "server_error"
    assert f"session 00010203 failed: {type(error).__name__}" in failure["error"]["message"]
    assert str(error) in failure["error"]["message"]
    assert core.runners[0].cancelled


class BrokenStatsRunner(Runner):
    """A bug past the status line, outside the session: reading the stats raises."""

    @property
    def stats(self):
        raise RuntimeError("stats exploded")

    @stats.setter
    def stats(self, value):
        pass


async def test_a_failure_past_the_status_line_never_starts_a_second_response(tokenizer, ids):
    """The middleware sees the bug after the stream was prepared: it ends the stream with the
    error event, never writes a new status line into the body."""
    core = Core([ids[:3]], runner=BrokenStatsRunner)
    client = await client_of(core, tokenizer)
    try:
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 50}
        )
        body = await asyncio.wait_for(r.read(), WAIT_S)
    finally:
        await client.close()
    assert r.status == 200 and b"HTTP/1.1" not in body
    *_, failure, done = events(body)
    assert done == "[DONE]"
    assert failure["error"]["type"] == "server_error"
    assert "RuntimeError: stats exploded" in failure["error"]["message"]
    assert core.runners[0].cancelled


# --- non-streaming: the client's fault before the session, the server's after --------------


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ResultRejected("result head does not chain"), 502),
        (RoundRefused(grpc.StatusCode.FAILED_PRECONDITION, "capture", "no capture"), 502),
        (RoundRefused(grpc.StatusCode.ABORTED, "head_mismatch", "head"), 502),
        (LinkDown("no answer from the verifier"), 503),
        (RuntimeError("disk full"), 500),
    ],
    ids=["rejected", "refused-precondition", "refused-aborted", "linkdown", "runtime"],
)
async def test_a_session_that_fails_after_it_started_is_a_server_error(
    tokenizer, ids, error, status
):
    core = Core([ids[:3]], error=error)
    client = await client_of(core, tokenizer)
    try:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        reply = await asyncio.wait_for(r.json(), WAIT_S)
    finally:
        await client.close()
    assert r.status == status, reply
    assert reply["error"]["type"] == "server_error"
    assert f"session 00010203 failed: {type(error).__name__}: {error}" == reply["error"]["message"]
    assert core.runners[0].cancelled


@pytest.mark.parametrize(
    ("refusal", "status"),
    [
        (RefusedError("prompt token 99 outside the vocabulary [0, 64)"), 400),
        (RoundRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_sessions", "64 open"), 429),
        (RoundRefused(grpc.StatusCode.FAILED_PRECONDITION, "context", "needs 4099"), 400),
        (LinkDown("open session: no answer from the verifier"), 503),
    ],
    ids=["refused", "session-limit", "context", "linkdown"],
)
async def test_a_session_refused_before_it_starts_keeps_its_status(tokenizer, refusal, status):
    client = await client_of(Core(refuse=refusal), tokenizer)
    try:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        reply = await r.json()
    finally:
        await client.close()
    assert r.status == status and str(refusal) == reply["error"]["message"]
    assert reply["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")


# --- fields not implemented yet are refused; unknown fields are ignored, as vLLM does --------


NOT_YET = [
    ("/v1/completions", "repetition_penalty", 1.5),
    ("/v1/completions", "min_p", 0.5),
    ("/v1/completions", "min_tokens", 10),
    ("/v1/completions", "prompt_logprobs", 3),
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "logprobs", 21),
    ("/v1/completions", "logprobs", True),
    ("/v1/completions", "frequency_penalty", False),
    ("/v1/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "logprobs", 1),
    ("/v1/chat/completions", "top_logprobs", 2),  # without logprobs: true
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/chat/completions", "stream_options", {"continuous_usage_stats": True}),
]


def body_for(path: str, **fields) -> dict:
    if path == "/v1/completions":
        return {"prompt": "x", "max_tokens": 4, **fields}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


@pytest.mark.parametrize(("path", "name", "value"), NOT_YET)
async def test_a_field_not_implemented_yet_is_refused_by_name_unless_neutral(
    tokenizer, ids, path, name, value
):
    core = Core([ids[:2]])
    client = await client_of(core, tokenizer)
    try:
        r = await client.post(path, json=body_for(path, stream=True, **{name: value}))
        reply = await r.json()
    finally:
        await client.close()
    assert r.status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].split(".")[0] == name and name in error["message"]
    assert core.runners == []  # no session was started


def test_the_refusal_says_what_is_accepted():
    from proposer_mac.openai_protocol import CompletionRequest, RequestError, parse

    with pytest.raises(RequestError, match=r"min_p=0.5 is not supported by this server yet"):
        parse(CompletionRequest, {"prompt": "x", "min_p": 0.5})
    with pytest.raises(RequestError, match=r"best_of=2 is not supported .*only 1"):
        parse(CompletionRequest, {"prompt": "x", "best_of": 2})
    assert parse(CompletionRequest, {"prompt": "x", "min_p": 0.0, "best_of": 1}).prompt == "x"


UNKNOWN = [
    ("/v1/completions", {"messages": [{"role": "user", "content": "hi"}], "zz_vendor": 1}),
    ("/v1/completions", {"top_logprobs": 0, "some_future_field": {"a": [1]}}),
    ("/v1/chat/completions", {"prompt": "x", "mm_processor_kwargs": {}}),
]


@pytest.mark.parametrize(("path", "fields"), UNKNOWN)
async def test_unknown_fields_are_accepted_and_logged_as_ignored(
    tokenizer, ids, path, fields, caplog
):
    core = Core([ids[:2]])
    client = await client_of(core, tokenizer)
    try:
        with caplog.at_level("WARNING", logger="muser.http"):
            r = await client.post(path, json=body_for(path, **fields))
            reply = await r.json()
    finally:
        await client.close()
    assert r.status == 200, reply
    assert len(core.runners) == 1
    ignored = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert ignored and all(name in ignored[0] for name in fields), ignored


ACCEPTED = [
    ("/v1/completions", {"user": "u1", "metadata": {"k": "v"}, "n": 1, "echo": False}),
    ("/v1/completions", {"logprobs": None, "best_of": 1, "suffix": "", "frequency_penalty": 0.0}),
    ("/v1/completions", {"presence_penalty": 0, "logit_bias": {}, "min_p": None}),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"seed": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5}),
    ("/v1/completions", {"max_completion_tokens": 4, "stop": ["zz"], "ignore_eos": True}),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0, "tools": []}),
    ("/v1/chat/completions", {"tool_choice": "none", "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"functions": [], "user": "u1", "model": "target"}),
    ("/v1/completions", {"stop_token_ids": [5], "include_stop_str_in_output": True}),
    ("/v1/completions", {"skip_special_tokens": False, "echo": True, "priority": 3}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/chat/completions", {"add_generation_prompt": False, "continue_final_message": True}),
    ("/v1/chat/completions", {"request_id": "r1", "parallel_tool_calls": False, "echo": False}),
]


@pytest.mark.parametrize(("path", "fields"), ACCEPTED)
async def test_fields_read_or_harmless_are_accepted(tokenizer, ids, path, fields):
    client = await client_of(Core([ids[:2]]), tokenizer)
    try:
        r = await client.post(path, json=body_for(path, **fields))
        reply = await r.text()
    finally:
        await client.close()
    assert r.status == 200, reply


# --- an oversized body ---------------------------------------------------------------------


async def test_an_oversized_body_is_refused_naming_the_limit_and_its_size(tokenizer):
    client = await client_of(Core(), tokenizer, max_message_bytes=1024)
    body = json.dumps({"prompt": "x" * 2000}).encode()

    async def chunked():  # no Content-Length: the size is only known as it is read
        yield body

    try:
        r = await client.post("/v1/completions", data=body)
        sized = await r.json()
        r2 = await client.post("/v1/completions", data=chunked())
        unsized = await r2.json()
    finally:
        await client.close()
    assert r.status == 413 and r2.status == 413
    assert sized["error"]["message"] == (
        f"the request body is {len(body)} bytes; this server reads at most "
        "limits.max_message_bytes = 1024 bytes"
    )
    assert unsized["error"]["message"].startswith("the request body is over 1024 bytes;")
    assert sized["error"]["type"] == "invalid_request_error"


# --- a client that leaves a non-streaming request ------------------------------------------


async def test_a_client_that_leaves_a_non_streaming_request_cancels_its_session(tokenizer, ids):
    """The real server (serve_http): the handler is cancelled when the connection closes,
    and its `finally` cancels the session long before the session would end."""
    tokens = [[t] for t in (ids * 10)]
    core = Core(tokens, delay=0.05)  # ~2.5 s to run to the end
    runner, port = await http_api.serve_http(app_of(core, tokenizer), "127.0.0.1:0")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": "x", "max_tokens": 100}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        for _ in range(100):
            if core.runners and core.runners[0].waits > 2:
                break
            await asyncio.sleep(0.01)
        writer.close()
        await writer.wait_closed()
        session = core.runners[0]
        for _ in range(50):
            if session.cancelled:
                break
            await asyncio.sleep(0.01)
        assert session.cancelled, "the session outlived the client by 0.5 s"
        assert session.waits < len(tokens) // 2
    finally:
        await runner.cleanup()


# --- malformed bodies: a 4xx naming what was wrong, never a 500 -----------------------------

MALFORMED = [
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
     "nests arrays or objects too deeply"),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt",
     "prompt is not valid Unicode text: a lone surrogate '\\ud800' at character 0"),
    ("/v1/completions", b'{"prompt": "x", "top_k": 4294967296}', "top_k",
     "top_k: Input should be less than 4294967296, got 4294967296"),
    ("/v1/completions", b"null", None, "the request body is a JSON null; expected an object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "messages[0]",
     "messages[0] must be {role: string, content: string or text parts}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": {"text": "x"}}]}',
     "messages[0]", "content: string or text parts"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}',
     "messages[0]", "content: string or text parts"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\udfff", "content": "x"}]}',
     "messages[0].role", "messages[0].role is not valid Unicode text"),
    ("/v1/completions", json.dumps({"prompt": [1] * 2049}).encode(), "prompt",
     "prompt is a list of 2049 token ids; the model's context window is 2048 positions"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "message"), MALFORMED)
async def test_a_malformed_body_gets_a_4xx_naming_what_was_wrong(
    tokenizer, path, body, param, message
):
    """Regression (issue 35): a deeply nested body, a lone surrogate and a top_k beyond 32
    bits each ended in a 500 with the exception's text; chat content that was a number or an
    object was rendered into the prompt."""
    core = Core()
    client = await client_of(core, tokenizer, max_message_bytes=4 << 20)
    try:
        r = await client.post(path, data=body, headers={"Content-Type": "application/json"})
        reply = await r.json()
    finally:
        await client.close()
    assert r.status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param
    assert message in reply["error"]["message"]
    assert core.runners == []  # no session started


async def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(tokenizer):
    """The byte count of a prompt (or of chat messages) against the context window times the
    longest vocabulary entry: beyond it no tokenization fits, and nothing is tokenized."""
    app = app_of(Core(), tokenizer, max_message_bytes=4 << 20)
    api = app[http_api.API]
    limit = 2048 * api.token_bytes
    assert api.token_bytes == max(len(k.encode()) for k in tokenizer.get_vocab())
    calls = []
    real = tokenizer.encode

    def counting(text, **kw):
        calls.append(len(text))
        return real(text, **kw)

    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        tokenizer.encode = counting
        prompt = await client.post("/v1/completions", json={"prompt": "é" * (limit // 2 + 1)})
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x" * (limit - 3)}]},
        )
        replies = await prompt.json(), await chat.json()
    finally:
        del tokenizer.encode
        await client.close()
    assert (prompt.status, chat.status) == (400, 400)
    assert replies[0]["error"]["message"] == (
        f"prompt is {2 * (limit // 2 + 1)} bytes of text; no token of this model spells more "
        f"than {api.token_bytes} bytes, so it cannot fit the model's context window of 2048 "
        f"tokens (at most {limit} bytes of text); nothing was tokenized"
    )
    assert replies[1]["error"]["message"].startswith(f"messages is {limit + 1} bytes of text")
    assert replies[0]["error"]["code"] == "context_length_exceeded"
    assert calls == []


async def test_a_body_with_more_values_than_any_request_can_hold_is_refused_unparsed(tokenizer):
    app = app_of(Core(), tokenizer, max_message_bytes=8 << 20)
    api = app[http_api.API]
    over = api.separator_limit + 1
    body = b'{"prompt": [' + b"1," * over + b"1]}"
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        r = await client.post("/v1/completions", data=body)
        reply = await r.json()
    finally:
        await client.close()
    assert r.status == 413
    assert reply["error"]["message"] == (
        f"the request body holds {over} commas; a request that fits the model's context "
        f"window of 2048 tokens holds at most {api.separator_limit}; nothing was parsed"
    )
