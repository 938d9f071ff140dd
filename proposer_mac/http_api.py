"""The OpenAI-compatible HTTP API of the proposer daemon, served by aiohttp on the daemon's
asyncio loop next to its grpc.aio server.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent events
or not), and what `proposer_mac.http_model` serves (`/v1/models`, `/tokenize`, `/detokenize`,
`/version`, `/health`). Each choice of a request (its prompts times `n`) is one session,
started through `ProposerCore.start_session` exactly like a gRPC Generate, and its text is
made only of durable tokens (COMMITTED fsynced). `seed` is the session's MT19937 seed, the
same mapping as `muser generate --seed` (choice j takes seed + j), so a seeded request
reproduces the local lane token for token.

Text is decoded from the whole token list on every update, so a delta never splits a UTF-8
character or a BPE merge and the streamed deltas concatenate to the non-streaming text.
Stop strings cut the text and end the response. Errors before the session starts are the
request's (4xx, or the verifier's status for its open); a session that fails after it
started is a server error (5xx; once streaming, an error event before [DONE]). A client
that disconnects cancels its handler and so its session. Other routes (the daemon's
`/metrics`) join the same app through `create_app(..., extra_routes=...)`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from cluster_config import ClusterConfig
from muser.errors import MuserError, RefusedError
from muser.http_auth import bearer_auth
from muser.sampling import SamplingParams
from proposer_mac import http_model
from proposer_mac.http_body import API, PREPARE, json_body, off_loop
from proposer_mac.http_reply import Choice, Reply, merged_pieces
from proposer_mac.link import LinkDown
from proposer_mac.openai_protocol import ChatCompletionRequest, CompletionRequest
from proposer_mac.openai_request import (
    COMPLETION_MAX_TOKENS,
    Api,
    ApiError,
    ChatForm,
    chat_messages,
    chat_prompt,
    check_choices,
    check_messages_fit,
    check_model,
    encode_text,
    max_token_bytes,
    prompt_tokens,
    request,
    sampling_params,
)
from proposer_mac.text_stream import TextStream

log = logging.getLogger("muser.http")

_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


def api_error(exc: BaseException) -> ApiError:
    """Map an error raised before a session started (the request's checks, the session's
    open) to one HTTP status: refused input 400, the verifier's status mapped (its session
    limit 429), verifier down 503, else 500. Failures of a session that started are
    `session_error`'s."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RefusedError):
        return ApiError(str(exc))
    code = getattr(exc, "code", None)
    status = _GRPC_STATUS.get(code, 500) if isinstance(code, grpc.StatusCode) else 500
    if isinstance(exc, LinkDown):
        status = 503
    return ApiError(str(exc), status=status)


_STREAMING: Any = (
    web.RequestKey("muser_streaming", web.StreamResponse)
    if hasattr(web, "RequestKey")  # aiohttp >= 3.13; plain keys before it
    else "muser_streaming"
)
"""The event stream a handler prepared: once its status line is sent, no other response."""


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = ApiError(f"{request.method} {request.path}: {exc.reason}", status=exc.status)
    except MuserError as exc:
        error = api_error(exc)
    except ApiError as exc:
        error = exc
    except Exception as exc:  # a bug: the client still gets error JSON, the log the traceback
        log.exception("%s %s failed", request.method, request.path)
        error = ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500)
    if error.status >= 500:
        log.error("%s %s: %s", request.method, request.path, error.message)
    stream = request.get(_STREAMING)
    if stream is not None:  # the status line is gone: the error travels as the last event
        await _end_stream(stream, error)
        return stream
    return web.json_response(error.body(), status=error.status)


# --- responses ------------------------------------------------------------------------------


async def _collect(reply: Reply) -> web.Response:
    texts = {c.index: [c.echo] for c in reply.choices}
    reasons: dict[int, str | None] = {}
    async for c, delta, reason in merged_pieces(reply.choices):
        texts[c.index].append(delta)
        if reason is not None:
            reasons[c.index] = reason
    body = {
        **reply.envelope(chunk=False),
        "choices": [
            reply.choice(c, "".join(texts[c.index]), reasons[c.index], chunk=False)
            for c in reply.choices
        ],
        "usage": reply.usage(),
        "muser": reply.muser(),
    }
    return web.json_response(body)


async def _send(resp: web.StreamResponse, body: dict) -> None:
    await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")


async def _end_stream(resp: web.StreamResponse, error: ApiError) -> None:
    """Best effort, after a failure past the status line: the error event, [DONE], the end
    of the body (a client that left, or a body already ended, gets nothing more)."""
    try:
        await _send(resp, error.body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionError, RuntimeError) as exc:  # RuntimeError: written after write_eof
        log.info("could not end the event stream with the error: %s", exc)


async def _stream(request: web.Request, reply: Reply, include_usage: bool) -> web.StreamResponse:
    """Server-sent events: one chunk per durable delta of each choice, its reason last, then
    [DONE]; a failure of a session travels as an error event before [DONE]."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    request[_STREAMING] = resp
    head = reply.envelope(chunk=True)
    try:
        for c in reply.choices:
            if reply.chat:
                first = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                await _send(
                    resp, {**head, "choices": [{**first, "logprobs": None, "finish_reason": None}]}
                )
            elif c.echo:
                await _send(resp, {**head, "choices": [reply.choice(c, c.echo, None, True)]})
        try:
            async for c, delta, reason in merged_pieces(reply.choices):
                extra = {"muser": c.muser()} if reason else {}
                await _send(
                    resp, {**head, "choices": [reply.choice(c, delta, reason, True)], **extra}
                )
            if include_usage:
                usage = {"usage": reply.usage(), "muser": reply.muser()}
                await _send(resp, {**head, "choices": [], **usage})
        except ApiError as exc:  # (text_pieces') the status line is gone: an event
            log.error("%s %s: %s", request.method, request.path, exc.message)
            await _send(resp, exc.body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        sid = reply.choices[0].runner.session.session_id.hex()[:8]
        log.info("client left session %s mid-stream", sid)
    return resp


@dataclass(frozen=True)
class Prepared:
    """A request body checked and turned into what its sessions need: a (prompt, params,
    echo) per choice, in choice order."""

    choices: list[tuple[list[int], SamplingParams, str]]
    prompt_tokens: int
    user_stops: frozenset[int]
    stops: tuple[str, ...]
    include_stop: bool
    skip_special: bool
    stream: bool
    include_usage: bool
    token_ids: bool


def prepare(body: dict, api: Api, chat: bool) -> Prepared:
    """Every check of a parsed body and its prompts' tokens (blocking: rendering a chat
    template and tokenizing take milliseconds to seconds; the handlers run it in the app's
    preparing thread). Raises ApiError (4xx) naming the field."""
    req = request(ChatCompletionRequest if chat else CompletionRequest, body)
    check_model(api, req.model)
    if chat:
        prompts, max_new, default_max = [(chat_tokens(req, api), "")], req.max_new, None
    else:
        items = req.prompts()
        check_choices(api, len(items), req.n)  # before tokenizing them all
        prompts = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            ids = prompt_tokens(api, item, param, req.add_special_tokens)
            echo = (
                "" if not req.echo else item if isinstance(item, str) else api.tokenizer.decode(ids)
            )
            prompts.append((ids, echo))
        max_new, default_max = req.max_tokens, COMPLETION_MAX_TOKENS
    check_choices(api, len(prompts), req.n)
    choices = [
        (ids, params, echo)
        for ids, echo in prompts
        for params in sampling_params(req, api, len(ids), max_new, default_max)
    ]
    return Prepared(
        choices,
        sum(len(ids) for ids, _ in prompts),
        frozenset(req.stop_token_ids),
        req.stops,
        req.include_stop_str_in_output,
        req.skip_special_tokens,
        req.stream,
        req.include_usage,
        req.return_tokens_as_token_ids,
    )


def chat_tokens(req: ChatCompletionRequest, api: Api) -> list[int]:
    """The chat request's prompt: messages checked and measured, rendered, tokenized."""
    messages = chat_messages(req.messages)
    check_messages_fit(api, messages)
    text = chat_prompt(api.tokenizer, messages, ChatForm.of(req))
    return encode_text(api, text, "messages", special=req.add_special_tokens)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    api = request.app[API]
    body = await json_body(request)
    job = await off_loop(request, prepare, body, api, chat)
    choices: list[Choice] = []
    try:
        for index, (prompt, params, echo) in enumerate(job.choices):
            runner = await api.core.start_session(prompt, params, detached=True)
            text = TextStream(
                api.tokenizer,
                job.stops,
                include_stop=job.include_stop,
                skip_special=job.skip_special,
            )
            choices.append(Choice(index, runner, text, echo))
        reply = Reply(api, chat, choices, job.prompt_tokens, job.user_stops, job.token_ids)
        if job.stream:
            return await _stream(request, reply, job.include_usage)
        return await _collect(reply)
    finally:  # a stop string, a finished reply or a client gone: nobody reads the rest
        for c in choices:
            c.runner.cancel()


# --- handlers and the app -------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


def create_app(
    core,
    config: ClusterConfig,
    tokenizer,
    *,
    model_id: str | None = None,
    context_length: int | None = None,
    extra_routes: Sequence[web.RouteDef] = (),
    clock: Callable[[], float] = time.time,
) -> web.Application:
    """The OpenAI-compatible app over `core` (ProposerCore); `extra_routes` (e.g. /metrics)
    are served by the same app. The served names are http.served_model_name, else `model_id`,
    else the target checkpoint's folder."""
    keys = config.http.secrets()
    app = web.Application(
        # the key before any work; /health and /version answer without one
        middlewares=[bearer_auth(keys, open_paths=http_model.OPEN_PATHS), _errors],
        client_max_size=config.limits.max_message_bytes,
    )
    names = tuple(config.http.served_model_name) or (
        model_id or http_model.served_model_id(config.verifier.target),
    )
    app[API] = Api(
        core,
        tokenizer,
        names[0],
        config.limits.max_tokens,
        context_length,
        clock,
        int(clock()),
        max_token_bytes(tokenizer),
        served_names=names,
        max_n=config.http.max_n,
    )
    pool = ThreadPoolExecutor(1, thread_name_prefix="http-prepare")
    app[PREPARE] = pool

    async def _shutdown(_app: web.Application) -> None:
        pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_shutdown)
    app.add_routes(
        [
            web.post("/v1/completions", _completions),
            web.post("/v1/chat/completions", _chat_completions),
            *http_model.ROUTES,
            *extra_routes,
        ]
    )
    return app


async def serve_http(
    app: web.Application, address: str, ssl_context=None
) -> tuple[web.AppRunner, int]:
    """Start `app` on HOST:PORT on the running loop (HTTPS with `ssl_context`); returns
    (runner, bound port)."""
    host, _, port = address.rpartition(":")
    # handler_cancellation: a client that disconnects cancels its handler, whose `finally`
    # (`_generate`) cancels the session; without it a non-streaming request runs to its end
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, int(port), ssl_context=ssl_context).start()
    except OSError as exc:
        await runner.cleanup()
        raise RefusedError(f"cannot bind the proposer http address {address}: {exc}") from exc
    return runner, runner.addresses[0][1]
