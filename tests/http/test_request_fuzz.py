"""Property test of the HTTP API's request checks (issue 35): whatever JSON a client sends,
the API either prepares a session from it or refuses it with a 4xx naming what was wrong;
never another exception (a 500 with a traceback). Pure functions: no server, no session."""

from __future__ import annotations

import json
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proposer_mac import http_api
from proposer_mac.openai_protocol import ChatCompletionRequest, CompletionRequest
from proposer_mac.openai_request import ApiError, parse_body

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
SURROGATES = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3
)
MESSAGE = st.fixed_dictionaries(
    {}, optional={"role": JSON | st.sampled_from(["user", "system", "assistant"]),
                  "content": JSON | SURROGATES | st.lists(st.fixed_dictionaries({"text": JSON}))},
)  # fmt: skip


def bodies(endpoint) -> st.SearchStrategy[dict]:
    """Objects whose keys are mostly the endpoint's own (so values reach every check), with
    values of any JSON kind, a few unknown keys, chat messages of any shape."""
    known = sorted({*endpoint.model_fields, *endpoint.NOT_YET})
    value = JSON | SURROGATES
    special = {
        "messages": st.lists(MESSAGE, max_size=3) | JSON,
        "prompt": value | st.lists(st.integers(-5, 5000), max_size=6),
    }
    fields = {k: special.get(k, value) for k in known}
    return st.fixed_dictionaries({}, optional=fields) | st.dictionaries(
        st.text(max_size=6), value, max_size=3
    )


@pytest.fixture(scope="module")
def api(tokenizer):
    core = types.SimpleNamespace()
    return http_api.Api(
        core, tokenizer, "target", 4096, 2048, lambda: 0.0, 0,
        http_api.max_token_bytes(tokenizer),
    )  # fmt: skip


def check(api, body: dict, chat: bool) -> None:
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    try:
        http_api.prepare(parse_body(raw, api), api, chat)
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.message
        assert exc.message and exc.body()["error"]["type"] == "invalid_request_error"


FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(body=bodies(CompletionRequest))
def test_any_completion_body_is_prepared_or_refused_with_a_4xx(api, body):
    check(api, body, chat=False)


@FUZZ
@given(body=bodies(ChatCompletionRequest))
def test_any_chat_body_is_prepared_or_refused_with_a_4xx(api, body):
    check(api, body, chat=True)


LONG = settings(FUZZ, max_examples=10_000)


@pytest.mark.slow
@LONG
@given(body=bodies(CompletionRequest))
def test_ten_thousand_completion_bodies_are_prepared_or_refused_with_a_4xx(api, body):
    check(api, body, chat=False)


@pytest.mark.slow
@LONG
@given(body=bodies(ChatCompletionRequest))
def test_ten_thousand_chat_bodies_are_prepared_or_refused_with_a_4xx(api, body):
    check(api, body, chat=True)
