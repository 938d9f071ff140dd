"""Durable tokens -> text deltas: whole characters only, stop strings cut, no cluster."""

from __future__ import annotations

import pytest

from proposer_mac.openai_request import chat_prompt, simple_chat_prompt
from proposer_mac.text_stream import TextStream

TEXT = "héllo 世界 ✓ done.\nnext line: ünïcödé ends here\n"


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    tokens = list(tokenizer.encode(TEXT, add_special_tokens=False))
    partial = [tokenizer.decode(tokens[:k]) for k in range(len(tokens))]
    assert any(p.endswith("\ufffd") for p in partial), "the text must split a character"
    return tokens


def feed_one_by_one(stream: TextStream, tokens: list[int]) -> list[str]:
    deltas = [stream.feed([t], final=i == len(tokens) - 1) for i, t in enumerate(tokens)]
    return [d for d in deltas if d]


def test_deltas_never_split_a_character_and_concatenate_to_the_whole(tokenizer, ids):
    deltas = feed_one_by_one(TextStream(tokenizer), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_chunked_feeds_give_the_same_text(tokenizer, ids, chunk):
    stream = TextStream(tokenizer)
    parts = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    out = "".join(stream.feed(p, final=i == len(parts) - 1) for i, p in enumerate(parts))
    assert out == TEXT


def test_stop_string_cuts_the_text_and_counts_tokens_through_it(tokenizer, ids):
    stream = TextStream(tokenizer, ["line:", "never"])
    deltas = []
    for t in ids:
        deltas.append(stream.feed([t]))
        if stream.stopped:
            break
    assert "".join(deltas) == TEXT[: TEXT.index("line:")]
    covered = tokenizer.decode(stream.tokens)
    assert "line:" in covered and "line:" not in tokenizer.decode(stream.tokens[:-1])


def test_a_possible_stop_prefix_is_held_back_until_it_resolves(tokenizer, ids):
    """ "done!" never occurs, but "done" does: it is held back, then released."""
    stream = TextStream(tokenizer, ["done!"])
    sent = ""
    for t in ids:
        sent += stream.feed([t])
        if sent.endswith("done"):
            pytest.fail("text that may begin a stop string was sent early")
    sent += stream.feed([], final=True)
    assert sent == TEXT and not stream.stopped


def test_earliest_stop_wins_and_a_stop_inside_one_chunk_is_found(tokenizer, ids):
    stream = TextStream(tokenizer, ["ends", "✓"])
    assert stream.feed(ids, final=True) == TEXT[: TEXT.index("✓")]
    assert stream.stopped


def test_simple_chat_template_labels_roles_and_cues_the_assistant(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tokenizer.chat_template is None  # the fixtures have none: the simple one is used
    assert chat_prompt(tokenizer, messages) == "System: Be brief.\nUser: hi\nAssistant:"
    assert simple_chat_prompt(messages) == "System: Be brief.\nUser: hi\nAssistant:"


def test_the_checkpoint_chat_template_is_used_when_it_has_one(fixture_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fixture_pair.target))
    tok.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert chat_prompt(tok, [{"role": "user", "content": "hi"}]) == "<|user|>hi\n<|assistant|>"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1000])
def test_the_stop_that_completes_first_wins_however_the_tokens_arrive(tokenizer, ids, chunk):
    """ "done.\nnext" starts before "one" but "one" completes first: fed one token at a
    time "one" cuts the text, so it must in one chunk too."""
    stream = TextStream(tokenizer, ["done.\nnext", "one"])
    parts = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    out = ""
    for i, part in enumerate(parts):
        out += stream.feed(part, final=i == len(parts) - 1)
        if stream.stopped:
            break
    assert stream.stopped and out == TEXT[: TEXT.index("one")]
    covered = tokenizer.decode(stream.tokens)
    assert "one" in covered and "one" not in tokenizer.decode(stream.tokens[:-1])


def test_stops_ending_together_cut_at_the_longer_one(tokenizer, ids):
    """ "line:" and "e:" complete on the same character: the one starting first cuts."""
    for stops in (["e:", "line:"], ["line:", "e:"]):
        stream = TextStream(tokenizer, stops)
        assert stream.feed(ids, final=True) == TEXT[: TEXT.index("line:")]
