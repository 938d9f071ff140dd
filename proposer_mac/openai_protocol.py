"""Request bodies of the OpenAI-compatible API as schema models, shaped as `vllm serve` shapes
them (vLLM's `entrypoints/openai/protocol.py`).

- A field the server does not know is accepted, logged as ignored and never read, as vLLM
  does: clients send vLLM's and OpenAI's extras freely.
- A field it knows and honours is validated here (type, range; a JSON null counts as absent).
- A field it knows but does not implement yet is accepted only at its neutral value (the
  one that changes nothing: `logprobs` false, `frequency_penalty` 0, ...); any other value is
  refused naming the field, never ignored, since ignoring it would change the output the
  client asked for without a word.

Types are strict: `true` is no number, `1.0` no integer, `"1"` no number.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from muser.sampling import LOGPROBS_MAX

log = logging.getLogger("muser.http")

SEED_LIMIT = 2**32
"""Seeds are MT19937 init_genrand seeds: [0, 2**32)."""
TOKEN_ID_LIMIT = 2**31
"""Token ids travel as 32-bit integers; the vocabulary check names the real bound."""

Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]


class RequestError(ValueError):
    """A refused field: its dotted name and a message that says what was expected."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


class OpenAIBaseModel(BaseModel):
    """Unknown fields are kept aside and logged once per request as ignored (vLLM's
    `OpenAIBaseModel`); nulls count as absent."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    NOT_YET: ClassVar[dict[str, tuple]] = {}
    """Fields this server knows but does not implement, with the values accepted (neutral)."""

    @model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        """Nulls dropped (absent: the default); a field not implemented yet refused unless
        at a neutral value."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        for name, neutral in cls.NOT_YET.items():
            if name in data and not any(_same(data[name], n) for n in neutral):
                allowed = " or ".join(_json(n) for n in neutral) or "null"
                raise RequestError(
                    name,
                    f"{name}={_json_safe(data[name])} is not supported by this server yet "
                    f"(only {allowed}, the default, is accepted)",
                )
        return data

    @model_validator(mode="after")
    def _log_ignored(self) -> OpenAIBaseModel:
        ignored = sorted(set(self.model_extra or {}) - set(self.NOT_YET))
        if ignored:
            log.warning("The following fields were present in the request but ignored: %s", ignored)
        return self


def _json(value: Any) -> str:
    return json.dumps(value)


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind: 0 is not False, 1.0 is 1."""

    def kind(v):
        if isinstance(v, bool):
            return bool
        return float if isinstance(v, int | float) else type(v)

    return kind(value) is kind(neutral) and value == neutral


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


_NOT_YET_BOTH: dict[str, tuple] = {
    "min_p": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "bad_words": ([],),
    "allowed_token_ids": ([],),
    "min_tokens": (0,),
    "prompt_logprobs": (0,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "truncate_prompt_tokens": (),
    "spaces_between_special_tokens": (True,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "logits_processors": (),
    "response_format": ({"type": "text"},),
}


class SamplingFields(OpenAIBaseModel):
    """What both endpoints share: the model, the session's sampling params, the stream."""

    model: str | None = None
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    temperature: Finite = Field(1.0, ge=0)
    top_p: Finite = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, lt=SEED_LIMIT)
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    request_id: str | None = None
    priority: int = 0
    return_tokens_as_token_ids: bool = False
    """Logprobs name each token as "token_id:ID" instead of its text (vLLM's flag)."""

    @model_validator(mode="after")
    def _check(self) -> SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if not all(stops):
            raise RequestError("stop", f"stop must hold non-empty strings, got {self.stop!r}")
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "stream_options",
                "stream_options can only be given with stream: true",
            )
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | list[TokenId] | list[str] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    NOT_YET: ClassVar[dict[str, tuple]] = {
        **_NOT_YET_BOTH,
        "best_of": (1,),
        "suffix": ("",),
    }

    prompt: Prompt
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    add_special_tokens: bool = True
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    """Each token's log-probability and this many most probable alternatives."""

    @model_validator(mode="after")
    def _echo_has_no_prompt_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise RequestError(
                "echo",
                "echo with logprobs asks for the prompt's logprobs, which this server does not "
                "give yet; ask for one or the other",
            )
        return self

    @property
    def alternatives(self) -> int | None:
        """Alternatives each token's logprobs carry; None: no logprobs."""
        return self.logprobs

    @model_validator(mode="after")
    def _every_prompt_non_empty(self) -> CompletionRequest:
        batch = self.prompts()
        for i, one in enumerate(batch):
            if not one:
                raise RequestError(
                    f"prompt[{i}]" if len(batch) > 1 else "prompt",
                    f"prompt must be a non-empty string or list of token ids, got {_json(one)}",
                )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (each its own choices)."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    NOT_YET: ClassVar[dict[str, tuple]] = {
        **_NOT_YET_BOTH,
        "tools": ([],),
        "functions": ([],),
        "tool_choice": ("none", "auto"),
        "echo": (False,),
        "documents": ([],),
        "reasoning_effort": (),
        "chat_template": (),  # a template from the request is not trusted (vLLM's default)
    }

    messages: list[Any] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=LOGPROBS_MAX)

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> ChatCompletionRequest:
        return _check_prompt_kind(self)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise RequestError(
                "top_logprobs", "top_logprobs needs logprobs: true (it counts their alternatives)"
            )
        return self

    @property
    def alternatives(self) -> int | None:
        """Alternatives each token's logprobs carry; None: no logprobs."""
        return self.top_logprobs if self.logprobs else None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _check_prompt_kind(request):
    """A chat prompt ends with the assistant's cue or continues the final message, not both."""
    if request.continue_final_message and request.add_generation_prompt:
        raise RequestError(
            "continue_final_message",
            "cannot set both continue_final_message and add_generation_prompt to true "
            "(add_generation_prompt defaults to true: set it to false to continue the final "
            "message)",
        )
    return request


class TokenizeCompletionRequest(OpenAIBaseModel):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    """POST /tokenize with chat messages (rendered as /v1/chat/completions renders them)."""

    NOT_YET: ClassVar[dict[str, tuple]] = {"tools": ([],), "chat_template": ()}

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> TokenizeChatRequest:
        return _check_prompt_kind(self)


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


def parse(model: type[OpenAIBaseModel], body: dict) -> Any:
    """`body` as `model`, or RequestError naming the first field refused and what it wanted."""
    try:
        return model.model_validate(body)
    except RequestError:
        raise
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, RequestError):
            raise cause from None
        where = ".".join(str(p) for p in err["loc"] if not _union_branch(p))
        got = err.get("input")
        got_text = "missing" if err["type"] == "missing" else f"got {_json_safe(got)}"
        raise RequestError(
            where or "body", f"{where or 'body'}: {err['msg']}, {got_text}"
        ) from None


def _union_branch(part: object) -> bool:
    """Pydantic names the union member it tried (`str`, `list[int]`) in an error's location."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"})


def _json_safe(value: Any) -> str:
    try:
        return _json(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]
