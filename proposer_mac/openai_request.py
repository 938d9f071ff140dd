"""OpenAI request bodies to sessions: the checks and conversions behind the proposer's
OpenAI-compatible API (proposer_mac.http_api), free of HTTP. A body becomes sampling params
(`seed` is the session's MT19937 seed, as `muser generate --seed`) and prompt tokens (text,
token ids, or chat messages through the checkpoint's chat template); anything this server
does not implement is refused with the parameter named, never ignored."""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from muser.sampling import SamplingParams

SEED_LIMIT = 2**32
"""Seeds are MT19937 init_genrand seeds: [0, 2**32)."""
COMPLETION_MAX_TOKENS = 16
"""OpenAI's documented default for /v1/completions; chat fills the context instead."""

HONOURED = frozenset(
    {
        "model", "n", "seed", "temperature", "top_p", "top_k", "max_tokens",
        "max_completion_tokens", "stop", "stream", "stream_options", "ignore_eos",
    }
)  # fmt: skip
"""Fields every endpoint reads (each checked where it is read)."""
HARMLESS = frozenset({"user", "metadata"})
"""Fields that never change the output: accepted and not read."""
STREAM_OPTIONS = frozenset({"include_usage"})

# Fields this server does not implement, accepted only at their neutral values (a value that
# means "off"); any field not named here or above is refused, never silently ignored.
_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
}
COMPLETION_NEUTRAL: dict[str, tuple] = {
    **_NEUTRAL,
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "logprobs": (False,),  # an integer asks for logprobs (0: the sampled token's)
}
CHAT_NEUTRAL: dict[str, tuple] = {
    **_NEUTRAL,
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
}


@dataclass(frozen=True)
class Endpoint:
    """The fields one route takes: what it reads, and what it takes at a neutral value."""

    name: str
    reads: frozenset[str]
    neutral: dict[str, tuple]

    @property
    def known(self) -> frozenset[str]:
        return self.reads | HARMLESS | frozenset(self.neutral)


COMPLETIONS = Endpoint("/v1/completions", HONOURED | {"prompt"}, COMPLETION_NEUTRAL)
CHAT = Endpoint("/v1/chat/completions", HONOURED | {"messages"}, CHAT_NEUTRAL)


def _same(value, neutral) -> bool:
    """Equal and of the same kind: 0 is not False, 1.0 is 1."""

    def kind(v):
        if isinstance(v, bool):
            return bool
        return float if isinstance(v, int | float) else type(v)

    return kind(value) is kind(neutral) and value == neutral


class ApiError(Exception):
    """A refused request, rendered as OpenAI error JSON with this HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class Api:
    """What the handlers share: the core that opens sessions and the model they serve."""

    core: Any  # ProposerCore (not imported: the app is testable on a stand-in)
    tokenizer: Any
    model_id: str
    max_tokens: int
    context_length: int | None
    clock: Callable[[], float]
    created: int = 0
    token_bytes: int | None = None
    """The most UTF-8 bytes one vocabulary entry spells (`max_token_bytes`): with the
    context window, how much prompt text could possibly fit, checked before tokenizing."""

    @property
    def text_limit(self) -> int | None:
        return text_limit(self.context_length, self.token_bytes)

    @property
    def separator_limit(self) -> int | None:
        """The most commas a body this model could take holds: one per token id of a
        prompt that fills the context, one per byte of text (inside strings), a few per
        message (each spends a byte of text on its role) and the other fields."""
        text = self.text_limit
        return None if text is None else 4 * text + self.context_length + 1024


def text_limit(context_length: int | None, token_bytes: int | None) -> int | None:
    """Bytes of prompt text beyond which no tokenization fits the context window (None:
    one of the two is unknown, and only limits.max_message_bytes bounds the text)."""
    if not context_length or not token_bytes:
        return None
    return context_length * token_bytes


def max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the bytes of text one token covers: the longest vocabulary entry in
    UTF-8 (a byte-level BPE entry spells each byte as one character of 1-2 bytes; a
    SentencePiece entry spells a space as 3 bytes, a fallback byte as 6). None when the
    tokenizer lists no vocabulary: then only limits.max_message_bytes bounds the text."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    return max((len(k.encode("utf-8", "surrogatepass")) for k in vocab), default=None)


def check_separators(raw: bytes, api: Api) -> None:
    """Refuse, before parsing, a body with more JSON separators than any request this model
    can take (`Api.separator_limit`): parsing a few million numbers holds the interpreter
    for a quarter of a second, and counting a byte is cheap."""
    limit = api.separator_limit
    if limit is None:
        return
    commas = raw.count(b",")
    if commas > limit:
        raise ApiError(
            f"the request body holds {commas} commas; a request that fits the model's context "
            f"window of {api.context_length} tokens holds at most {limit}; nothing was parsed",
            status=413,
            code="request_too_large",
        )


def utf8_size(text: str, param: str) -> int:
    """The text's size in UTF-8 bytes; a lone surrogate (JSON allows "\\ud800") is refused."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ApiError(
            f"{param} is not valid Unicode text: a lone surrogate {text[exc.start]!r} at "
            f"character {exc.start}; expected UTF-8 encodable text",
            param=param,
        ) from None


def check_text_fits(api: Api, size: int, param: str) -> None:
    """Refuse, before any tokenizing, text too long for any tokenization to fit the context
    window (a tokenizer of a few MB holds the interpreter for seconds)."""
    limit = api.text_limit
    if limit is not None and size > limit:
        raise ApiError(
            f"{param} is {size} bytes of text; no token of this model spells more than "
            f"{api.token_bytes} bytes, so it cannot fit the model's context window of "
            f"{api.context_length} tokens (at most {limit} bytes of text); nothing was "
            "tokenized",
            param=param,
            code="context_length_exceeded",
        )


def field(body: dict, name: str, kind: type, default, expected: str):
    """body[name] of `kind` (None counts as absent); bools are not numbers."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise ApiError(f"{name} must be {expected}, got {value!r}", param=name)
    return float(value) if kind is float else value


def check_common(body: dict, api: Api, endpoint: Endpoint) -> None:
    """The fields every request shares, and no field this server would ignore: one it does
    not know, or one it does not implement at a value other than its neutral one. A null
    counts as absent (the default, which changes nothing)."""
    for name, value in body.items():
        if value is None:
            continue
        if name not in endpoint.known:
            raise ApiError(
                f"unknown field {name!r}: POST {endpoint.name} takes "
                f"{', '.join(sorted(endpoint.known))}; a field this server would ignore is "
                "refused",
                param=name,
            )
        neutral = endpoint.neutral.get(name)
        if neutral is not None and not any(_same(value, n) for n in neutral):
            allowed = " or ".join(json.dumps(n) for n in neutral)
            raise ApiError(
                f"{name}={json.dumps(value)[:80]} is not supported by this server "
                f"(only {allowed}, the default, is accepted)",
                param=name,
            )
    model = body.get("model")
    if model is not None and model != api.model_id:
        raise ApiError(
            f"unknown model {model!r}; this server serves {api.model_id!r}",
            param="model",
            code="model_not_found",
        )
    n = field(body, "n", int, 1, "an integer")
    if n != 1:
        raise ApiError(f"n must be 1 (one choice per request), got {n}", param="n")
    options = field(body, "stream_options", dict, {}, "an object")
    unknown = sorted(set(options) - STREAM_OPTIONS)
    if unknown:
        raise ApiError(
            f"unknown stream_options field {unknown[0]!r}: this server takes "
            f"{', '.join(sorted(STREAM_OPTIONS))}",
            param=f"stream_options.{unknown[0]}",
        )


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(
            f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop"
        )
    return tuple(stops)


def _max_tokens(body: dict, api: Api, prompt_len: int, default: int | None) -> int:
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    room = None if api.context_length is None else api.context_length - prompt_len + 1
    if room is not None and room < 1:
        raise ApiError(
            f"a prompt of {prompt_len} tokens leaves no room in the model's context window of "
            f"{api.context_length} positions"
        )
    if default is None:
        default = api.max_tokens if room is None else min(api.max_tokens, room)
    value = field(body, name, int, default, "an integer >= 1")
    if value < 1:
        raise ApiError(f"{name} must be an integer >= 1, got {value}", param=name)
    if value > api.max_tokens:
        raise ApiError(
            f"{name} {value} exceeds this cluster's limit limits.max_tokens = {api.max_tokens}",
            param=name,
        )
    if room is not None and value > room:
        raise ApiError(
            f"a prompt of {prompt_len} tokens with {name} {value} needs "
            f"{prompt_len + value - 1} positions; the model's context window is "
            f"{api.context_length}",
            param=name,
        )
    return value


def sampling_params(
    body: dict, api: Api, prompt_len: int, default_max: int | None
) -> SamplingParams:
    """The session's fixed params from an OpenAI body (OpenAI defaults: temperature 1)."""
    temperature = field(body, "temperature", float, 1.0, "a number >= 0")
    if not math.isfinite(temperature) or temperature < 0:
        raise ApiError(f"temperature must be a number >= 0, got {temperature}", param="temperature")
    top_p = field(body, "top_p", float, 1.0, "a number in (0, 1]")
    if not 0 < top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = field(body, "top_k", int, 0, "an integer (0 or -1 = off)")
    if not -1 <= top_k < SEED_LIMIT:
        raise ApiError(
            f"top_k must be an integer in [-1, 2**32) (0 or -1 = off), got {top_k}", param="top_k"
        )
    seed = field(body, "seed", int, None, "an integer")
    if seed is None:
        seed = secrets.randbelow(SEED_LIMIT)
    elif not 0 <= seed < SEED_LIMIT:
        raise ApiError(f"seed must be in [0, 2**32), got {seed}", param="seed")
    ignore_eos = field(body, "ignore_eos", bool, False, "a boolean")
    eos = getattr(api.tokenizer, "eos_token_id", None)
    return SamplingParams(
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        max_tokens=_max_tokens(body, api, prompt_len, default_max),
        stop_tokens=() if ignore_eos or eos is None else (int(eos),),
        seed=seed,
    )


def encode_text(api: Api, text: str, param: str) -> list[int]:
    """Text to token ids, once its size is known to fit (`check_text_fits`). Blocking: the
    handlers call it in a worker thread."""
    check_text_fits(api, utf8_size(text, param), param)
    tokens = list(api.tokenizer.encode(text, add_special_tokens=False))
    if not tokens:
        raise ApiError(
            f"{param} {text!r} encodes to no tokens; give a non-empty prompt", param=param
        )
    return tokens


def prompt_tokens(body: dict, api: Api) -> list[int]:
    """A completion prompt: text or token ids, one prompt per request. Blocking (it may
    tokenize): the handlers call it in a worker thread."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(
            "missing required field 'prompt' (a string or a list of token ids)", param="prompt"
        )
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_text(api, prompt, "prompt")
    context = api.context_length
    if isinstance(prompt, list) and context is not None and len(prompt) > context:
        raise ApiError(
            f"prompt is a list of {len(prompt)} token ids; the model's context window is "
            f"{context} positions",
            param="prompt",
            code="context_length_exceeded",
        )
    ids = isinstance(prompt, list) and prompt
    if ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return list(ids)
    raise ApiError(
        f"prompt must be a non-empty string or list of token ids (one prompt per request), "
        f"got {json.dumps(prompt)[:80]}",
        param="prompt",
    )


def chat_messages(body: dict) -> list[dict[str, str]]:
    """Messages as {role, content} with text content (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            f"messages must be a non-empty list of {{role, content}} objects, got {messages!r}",
            param="messages",
        )
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) else None for p in content]
            content = "".join(parts) if all(isinstance(p, str) for p in parts) else None
        elif content is None and isinstance(m, dict) and m.get("role") == "assistant":
            content = ""
        elif not isinstance(content, str):  # a number, an object: not text
            content = None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or content is None:
            raise ApiError(
                f"messages[{i}] must be {{role: string, content: string or text parts}}, "
                f"got {json.dumps(m)[:80]}",
                param=f"messages[{i}]",
            )
        out.append({"role": m["role"], "content": content})
    return out


def check_messages_fit(api: Api, messages: list[dict[str, str]]) -> None:
    """The messages' text, measured before the chat template renders it (the template only
    adds to it): refused when no tokenization of it could fit the context window."""
    size = 0
    for i, m in enumerate(messages):
        size += utf8_size(m["role"], f"messages[{i}].role")
        size += utf8_size(m["content"], f"messages[{i}].content")
    check_text_fits(api, size, "messages")


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The checkpoint's own chat template when it has one, else role-labelled turns."""
    if not getattr(tokenizer, "chat_template", None):
        return simple_chat_prompt(messages)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja raises its own errors (e.g. roles out of order)
        raise ApiError(
            f"the model's chat template refused the messages: {exc}", param="messages"
        ) from exc


def simple_chat_prompt(messages: list[dict[str, str]]) -> str:
    """For checkpoints without a template (the fixtures): `Role: content` lines, then the
    assistant's cue."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
