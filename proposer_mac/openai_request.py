"""OpenAI request bodies to sessions: the checks and conversions behind the proposer's
OpenAI-compatible API (proposer_mac.http_api), free of HTTP. The body's fields are the schema
models' (`proposer_mac.openai_protocol`); here a parsed request becomes sampling params (`seed`
is the session's MT19937 seed, as `muser generate --seed`) and prompt tokens (text, token ids,
or chat messages through the checkpoint's chat template), with the checks that need the model:
its served names, its vocabulary, its context window."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from muser.sampling import SamplingParams
from proposer_mac.openai_protocol import SEED_LIMIT, RequestError, parse

COMPLETION_MAX_TOKENS = 16
"""OpenAI's documented default for /v1/completions; chat fills the context instead."""


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

    served_names: tuple[str, ...] = ()
    """Every name a request's `model` may give (`--served-model-name`); responses carry the
    first, `model_id`."""
    max_n: int = 16
    """The most choices one request may ask for (http.max_n): prompts times n."""
    vocab: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.served_names = self.served_names or (self.model_id,)
        self.vocab = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else 0

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


def parse_body(raw: bytes, api: Api | None = None) -> dict:
    """A request body as a JSON object, or the 4xx that says what it is instead (with `api`,
    a body too big in its count of values for any request to this model, before parsing)."""
    if api is not None:
        check_separators(raw, api)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(
            f"the request body is not valid JSON ({exc}); expected a JSON object"
        ) from None
    except RecursionError:
        raise ApiError(
            "the request body nests arrays or objects too deeply to parse; expected a JSON "
            "object of OpenAI request fields"
        ) from None
    if not isinstance(body, dict):
        kind = "null" if body is None else type(body).__name__
        raise ApiError(f"the request body is a JSON {kind}; expected an object")
    return body


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


def request(model: type, body: dict) -> Any:
    """`body` parsed as the endpoint's schema model; a refused field is a 400 naming it."""
    try:
        return parse(model, body)
    except RequestError as exc:
        raise ApiError(exc.message, param=exc.param) from None


def check_model(api: Api, model: str | None) -> None:
    """A request names one of the served names, or none (then the first is meant)."""
    if model and model not in api.served_names:
        raise ApiError(
            f"The model `{model}` does not exist; this server serves "
            f"{', '.join(repr(n) for n in api.served_names)}",
            param="model",
            status=404,
            code="model_not_found",
        )


def check_token_ids(api: Api, ids: list[int], param: str) -> None:
    """Token ids the target's tokenizer defines: [0, its vocabulary)."""
    if api.vocab:
        bad = [t for t in ids if t >= api.vocab]
        if bad:
            raise ApiError(
                f"{param} holds token id {bad[0]}; this model's tokenizer defines ids "
                f"0..{api.vocab - 1}",
                param=param,
            )


def check_choices(api: Api, prompts: int, n: int) -> None:
    if prompts * n > api.max_n:
        what = f"{prompts} prompts x n {n}" if prompts > 1 else f"n {n}"
        raise ApiError(
            f"{what} asks for {prompts * n} choices; this server gives at most {api.max_n} a "
            "request (http.max_n)",
            param="n",
        )


def _max_tokens(api: Api, asked: int | None, prompt_len: int, default: int | None) -> int:
    name = "max_tokens"
    room = None if api.context_length is None else api.context_length - prompt_len + 1
    if room is not None and room < 1:
        raise ApiError(
            f"a prompt of {prompt_len} tokens leaves no room in the model's context window of "
            f"{api.context_length} positions"
        )
    if default is None:
        default = api.max_tokens if room is None else min(api.max_tokens, room)
    value = default if asked is None else asked
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
    req, api: Api, prompt_len: int, max_new: int | None, default_max: int | None
) -> list[SamplingParams]:
    """The sessions' fixed params, one per choice (OpenAI defaults: temperature 1). Choice j
    of a request with seed S runs seed S + j (mod 2**32), so each choice is the one-choice
    request with that seed; without a seed each draws its own."""
    check_token_ids(api, list(req.stop_token_ids), "stop_token_ids")
    eos = getattr(api.tokenizer, "eos_token_id", None)
    stops = dict.fromkeys([*(() if req.ignore_eos or eos is None else (int(eos),))])
    stops.update(dict.fromkeys(req.stop_token_ids))
    max_tokens = _max_tokens(api, max_new, prompt_len, default_max)
    return [
        SamplingParams(
            temperature=req.temperature,
            top_k=max(req.top_k, 0),
            top_p=req.top_p,
            max_tokens=max_tokens,
            stop_tokens=tuple(stops),
            seed=secrets.randbelow(SEED_LIMIT) if req.seed is None else (req.seed + j) % SEED_LIMIT,
            logprobs=req.alternatives,
        )
        for j in range(req.n)
    ]


def encode_text(api: Api, text: str, param: str, *, special: bool = False) -> list[int]:
    """Text to token ids, once its size is known to fit (`check_text_fits`); `special`: the
    tokenizer adds its special tokens (a BOS where it says so). Blocking: the handlers call it
    in a worker thread."""
    check_text_fits(api, utf8_size(text, param), param)
    tokens = list(api.tokenizer.encode(text, add_special_tokens=special))
    if not tokens:
        raise ApiError(
            f"{param} {text!r} encodes to no tokens; give a non-empty prompt", param=param
        )
    return tokens


def prompt_tokens(api: Api, prompt: str | list[int], param: str, special: bool) -> list[int]:
    """One completion prompt, text or token ids. Blocking (it may tokenize): the handlers
    call it in a worker thread."""
    if isinstance(prompt, str):
        return encode_text(api, prompt, param, special=special)
    context = api.context_length
    if context is not None and len(prompt) > context:
        raise ApiError(
            f"{param} is a list of {len(prompt)} token ids; the model's context window is "
            f"{context} positions",
            param=param,
            code="context_length_exceeded",
        )
    check_token_ids(api, prompt, param)
    return list(prompt)


def chat_messages(messages: list) -> list[dict[str, str]]:
    """Messages as {role, content} with text content (text parts joined)."""
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


@dataclass(frozen=True)
class ChatForm:
    """How a chat prompt ends and what its template is told, as vLLM's requests say it."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, req) -> ChatForm:
        return cls(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)


def chat_prompt(tokenizer, messages: list[dict[str, str]], form: ChatForm = ChatForm()) -> str:
    """The checkpoint's own chat template when it has one, else role-labelled turns."""
    if not getattr(tokenizer, "chat_template", None):
        return simple_chat_prompt(messages, form)
    reserved = {"tokenize", "conversation", "add_generation_prompt", "continue_final_message"}
    clash = sorted(reserved & set(form.template_kwargs))
    if clash:
        raise ApiError(
            f"chat_template_kwargs may not set {clash[0]!r}: give it as a request field",
            param="chat_template_kwargs",
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=form.add_generation_prompt,
            continue_final_message=form.continue_final_message,
            **form.template_kwargs,
        )
    except Exception as exc:  # jinja raises its own errors (e.g. roles out of order)
        raise ApiError(
            f"the model's chat template refused the messages: {exc}", param="messages"
        ) from exc


def simple_chat_prompt(messages: list[dict[str, str]], form: ChatForm = ChatForm()) -> str:
    """For checkpoints without a template (the fixtures): `Role: content` lines, then the
    assistant's cue (or the final message left open, to be continued)."""
    if form.continue_final_message:
        *before, last = messages
        head = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in before)
        return head + f"{last['role'].capitalize()}: {last['content']}"
    turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return turns + ("Assistant:" if form.add_generation_prompt else "")
