"""A request's choices as OpenAI response bodies: each choice's session's durable tokens as
text deltas (`text_pieces`), every choice's deltas as they come (`merged_pieces`), and the
shapes the completions and chat endpoints give them (`Reply`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from muser.errors import MuserError
from muser.logprobs import TokenLogprobs
from proposer_mac.link import LinkDown, RoundRefused
from proposer_mac.openai_request import Api, ApiError
from proposer_mac.session import ResultRejected
from proposer_mac.text_stream import TextStream

log = logging.getLogger("muser.http")


def session_error(runner, exc: BaseException) -> ApiError:
    """A session that started and then failed: never the client's fault. The verifier
    unreachable 503; a refusal from it or a result that does not check out 502; anything
    else (a disk, a bug: its traceback logged here) 500. Always a server_error."""
    sid = runner.session.session_id.hex()[:8]
    if isinstance(exc, LinkDown):
        status = 503
    elif isinstance(exc, RoundRefused | ResultRejected):
        status = 502
    else:
        status = 500
    if not isinstance(exc, MuserError):
        log.error("session %s failed", sid, exc_info=exc)
    return ApiError(f"session {sid} failed: {type(exc).__name__}: {exc}", status=status)


# --- durable tokens -> text -----------------------------------------------------------------


def finish_reason(session) -> str:
    """An end-of-sequence token (or a stop string, found by the caller) ends with "stop";
    running out of max_tokens with "length"."""
    emitted, params = session.emitted, session.params
    if emitted and emitted[-1] in params.stop_tokens:
        return "stop"
    return "length" if len(emitted) >= params.max_tokens else "stop"


async def text_pieces(runner, text: TextStream) -> AsyncIterator[tuple[str, str | None]]:
    """(delta, finish_reason) from the runner's durable tokens; the last carries the reason.
    A failure of the session (whatever the runner raises) comes out as `session_error`'s
    ApiError."""
    offset = 0
    while True:
        try:
            tokens, done = await runner.wait_tokens(offset)
            offset += len(tokens)
            delta = text.feed(tokens, final=done)
        except Exception as exc:
            raise session_error(runner, exc) from exc
        if text.stopped:
            yield delta, "stop"
            return
        if done:
            yield delta, finish_reason(runner.session)
            return
        if delta:
            yield delta, None


@dataclass
class Choice:
    """One choice of a request: its session and the text its client reads."""

    index: int
    runner: Any  # SessionRunner
    text: TextStream
    echo: str = ""
    """Text sent ahead of the completion (the prompt, for `echo`)."""
    logprobs_sent: int = 0
    """Tokens whose logprobs went out already (a stream sends each token's once)."""
    text_offset: int = 0
    """Where the next token's text starts in the choice's text (completions' logprobs)."""

    def fresh_logprobs(self) -> list[tuple[int, TokenLogprobs]]:
        """(token, its logprobs) for the tokens the text covers that no response named yet;
        [] for a session that asked for none."""
        session = self.runner.session
        if session.params.logprobs is None:
            return []
        start, end = self.logprobs_sent, len(self.text.tokens)
        self.logprobs_sent = end
        return list(zip(self.text.tokens[start:end], session.logprobs[start:end], strict=True))

    def stop_reason(self, reason: str | None, user_stops: frozenset[int]) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or stop_token_ids entry that ended the
        choice; None for the end of sequence, max_tokens or a choice still running."""
        if reason != "stop":
            return None
        if self.text.stopped:
            return self.text.stopped
        emitted = self.runner.session.emitted
        return emitted[-1] if emitted and emitted[-1] in user_stops else None

    def muser(self) -> dict:
        """Our extension: the session and its acceptance statistics (muser.stats)."""
        s = self.runner.stats
        return {
            "session": self.runner.session.session_id.hex(),
            "seed": self.runner.session.params.seed,
            "rounds": s.rounds,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance": round(s.acceptance, 6),
            "tokens_per_round": round(s.tokens_per_round, 6),
        }


@dataclass
class Reply:
    """One request's choices and the shape its responses take."""

    api: Api
    chat: bool
    choices: list[Choice]
    prompt_tokens: int
    user_stops: frozenset[int]
    token_ids: bool = False
    """`return_tokens_as_token_ids`: logprobs name tokens by id."""

    def envelope(self, chunk: bool) -> dict:
        sid = self.choices[0].runner.session.session_id.hex()
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else None
        return {
            "id": f"chatcmpl-{sid}" if self.chat else f"cmpl-{sid}",
            "object": kind or "text_completion",
            "created": int(self.api.clock()),
            "model": self.api.model_id,
            "system_fingerprint": f"muser-{self.api.core.target_identity.model_digest[:16]}",
        }

    def choice(self, c: Choice, content: str, reason: str | None, chunk: bool) -> dict:
        out: dict[str, Any] = {"index": c.index}
        if not self.chat:
            out["text"] = content
        elif chunk:
            out["delta"] = {"content": content} if content else {}
        else:
            out["message"] = {"role": "assistant", "content": content}
        out.update(logprobs=self.logprobs(c), finish_reason=reason)
        if reason is not None or not chunk or not self.chat:  # (vLLM's chat chunks: last only)
            out["stop_reason"] = c.stop_reason(reason, self.user_stops)
        if reason is not None and len(self.choices) > 1:
            out["muser"] = c.muser()
        return out

    def logprobs(self, c: Choice) -> dict | None:
        """The choice's new tokens' logprobs as vLLM shapes them: chat's `content` list, or
        completions' parallel lists; None for a session that asked for none."""
        if c.runner.session.params.logprobs is None:
            return None
        fresh = c.fresh_logprobs()
        piece = self.piece
        if self.chat:
            return {
                "content": [
                    {
                        **_entry(piece(t), lp.logprob),
                        "top_logprobs": [
                            _entry(piece(i), v)
                            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
                        ],
                    }
                    for t, lp in fresh
                ]
            }
        offsets, tokens = [], []
        for t, _ in fresh:
            offsets.append(c.text_offset)
            tokens.append(piece(t))
            c.text_offset += len(tokens[-1])
        return {
            "text_offset": offsets,
            "token_logprobs": [_clamp(lp.logprob) for _, lp in fresh],
            "tokens": tokens,
            "top_logprobs": [
                {
                    piece(t): _clamp(lp.logprob),
                    **{
                        piece(i): _clamp(v)
                        for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
                    },
                }
                for t, lp in fresh
            ],
        }

    def piece(self, token: int) -> str:
        """One token as logprobs name it: its text, or "token_id:ID" when asked."""
        if self.token_ids:
            return f"token_id:{token}"
        return self.api.tokenizer.decode([token])

    def usage(self) -> dict:
        completion = sum(len(c.text.tokens) for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def muser(self) -> dict:
        """The first choice's session (each choice carries its own when there are several)."""
        return self.choices[0].muser()


LOGPROB_FLOOR = -9999.0
"""What a log-probability of minus infinity reads as in JSON (vLLM's floor)."""


def _clamp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _entry(token: str, logprob: float) -> dict:
    return {
        "token": token,
        "logprob": _clamp(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


_DONE = object()


async def merged_pieces(choices: list[Choice]) -> AsyncIterator[tuple[Choice, str, str | None]]:
    """(choice, delta, finish_reason) from every choice's session as each comes, each choice's
    in order; the first failure ends them all (its ApiError raised)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for delta, reason in text_pieces(c.runner, c.text):
                await queue.put((c, delta, reason))
        except ApiError as exc:
            await queue.put((c, exc, None))
        await queue.put((c, _DONE, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            c, delta, reason = await queue.get()
            if delta is _DONE:
                running -= 1
            elif isinstance(delta, ApiError):
                raise delta
            else:
                yield c, delta, reason
    finally:
        for task in tasks:
            task.cancel()
