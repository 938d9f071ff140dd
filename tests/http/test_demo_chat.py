"""The demo's chat request (muser_app/cli/demo.py `chat_stream`): streamed through the
OpenAI-compatible API, its text is plain decode's of the prompt the API renders, and the
statistics the demo's table reads come with it."""

from __future__ import annotations

import io

from muser.sampling import SamplingParams
from muser_app.cli.demo import chat_stream, demo_prompts
from muser_app.lanes.plain import run_plain
from verifier_gx.backends import load_target_backend


def test_the_demo_chat_is_plain_decode_of_the_rendered_prompt(
    http_cluster, fixture_pair, tokenizer
) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=48, stop_tokens=(int(tokenizer.eos_token_id),)
    )
    shown = io.StringIO()
    prompt, result = chat_stream(
        http_cluster.config.proposer.http, "Write a haiku.", params, tokenizer, shown.write
    )
    target = load_target_backend("torch", fixture_pair.target)
    plain = run_plain(target, prompt, params)
    text = tokenizer.decode(plain.tokens, skip_special_tokens=True)
    assert result["text"] == shown.getvalue() == text
    assert result["completion_tokens"] == len(plain.tokens)
    stats = result["stats"]
    assert stats["rounds"] >= 1 and stats["drafted"] >= stats["accepted"] >= 0
    assert stats["client_wall_s"] > 0


def test_the_demo_alternates_chat_and_code_on_the_real_pair(tokenizer) -> None:
    class Templated:
        chat_template = "x"

        def apply_chat_template(self, messages, **kw):
            return f"<chat>{messages[0]['content']}"

    real = demo_prompts("smollm2", 4, Templated())
    assert [kind for kind, _ in real] == ["chat", "code", "chat", "code"]
    assert real[1][1].startswith("def merge_sorted(")
    assert {kind for kind, _ in demo_prompts("toy", 3, tokenizer)} == {"code"}


def test_a_refused_chat_request_quotes_the_apis_reason(http_cluster, tokenizer) -> None:
    import pytest

    params = SamplingParams(temperature=-0.0, max_tokens=10**9)
    with pytest.raises(RuntimeError, match=r"refused the demo's chat request \(400\).*max_tokens"):
        chat_stream(http_cluster.config.proposer.http, "Hi", params, tokenizer, print)
