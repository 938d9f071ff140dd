"""The OpenAI-compatible HTTP API of the proposer daemon, served by aiohttp on the daemon's
asyncio loop next to its grpc.aio server.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (streaming as
server-sent events or not). A request becomes one session through
`ProposerCore.start_session`, exactly like a gRPC Generate, and its text is made only of
durable tokens (COMMITTED fsynced). `seed` is the session's MT19937 seed, the same mapping
as `muser generate --seed`, so a seeded request reproduces the local lane token for token.

Text is decoded from the whole token list on every update, so a delta never splits a UTF-8
character or a BPE merge and the streamed deltas concatenate to the non-streaming text.
Stop strings cut the text and end the response. Errors before the session starts are the
request's (4xx, or the verifier's status for its open); a session that fails after it
started is a server error (5xx; once streaming, an error event before [DONE]). A client
that disconnects cancels its handler and so its session. Other routes (the daemon's
`/metrics`) join the same app through `create_app(..., extra_routes=...)`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from cluster_config import ClusterConfig
from muser.errors import MuserError, RefusedError
from muser.http_auth import bearer_auth
from proposer_mac.link import LinkDown, RoundRefused
from proposer_mac.openai_request import (
    CHAT,
    COMPLETION_MAX_TOKENS,
    COMPLETIONS,
    Api,
    ApiError,
    chat_messages,
    chat_prompt,
    check_common,
    check_messages_fit,
    check_separators,
    encode_text,
    field,
    max_token_bytes,
    prompt_tokens,
    sampling_params,
    stop_strings,
)
from proposer_mac.session import ResultRejected
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


# --- the served model -----------------------------------------------------------------------


def served_model_id(target: Path) -> str:
    """The id clients name: the target checkpoint's folder (org/name for a hub snapshot)."""
    path = Path(target).resolve()
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--") :].replace("--", "/")
    return path.name


API = web.AppKey("muser_api", Api)


# --- request bodies -----------------------------------------------------------------------


def _too_large(request: web.Request, size: int | None) -> ApiError:
    limit = request.client_max_size
    got = f"{size} bytes" if size is not None else f"over {limit} bytes"
    return ApiError(
        f"the request body is {got}; this server reads at most "
        f"limits.max_message_bytes = {limit} bytes",
        status=413,
        code="request_too_large",
    )


PREPARE = web.AppKey("muser_prepare", ThreadPoolExecutor)
"""One worker thread for a request's heavy work before its session (parsing the body,
rendering the chat template, tokenizing): never on the event loop, which streams every
other client's tokens, and one request at a time, so several huge requests queue there
instead of sharing the interpreter with the loop."""


async def _off_loop(request: web.Request, fn, *args):
    """`fn(*args)` in the app's preparing thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[PREPARE], fn, *args)


async def _json_body(request: web.Request) -> dict:
    size = request.content_length
    if size is not None and size > request.client_max_size:
        raise _too_large(request, size)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # no Content-Length (chunked): counted as read
        raise _too_large(request, None) from None
    return await _off_loop(request, parse_body, raw, request.app[API])


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


# --- responses ------------------------------------------------------------------------------


@dataclass
class Reply:
    """One request's session and the shape its responses take."""

    api: Api
    chat: bool
    runner: Any  # SessionRunner
    text: TextStream

    def envelope(self, chunk: bool) -> dict:
        sid = self.runner.session.session_id.hex()
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else None
        return {
            "id": f"chatcmpl-{sid}" if self.chat else f"cmpl-{sid}",
            "object": kind or "text_completion",
            "created": int(self.api.clock()),
            "model": self.api.model_id,
            "system_fingerprint": f"muser-{self.api.core.target_identity.model_digest[:16]}",
        }

    def choice(self, content: str, reason: str | None, chunk: bool) -> dict:
        out: dict[str, Any] = {"index": 0}
        if not self.chat:
            out["text"] = content
        elif chunk:
            out["delta"] = {"content": content} if content else {}
        else:
            out["message"] = {"role": "assistant", "content": content}
        return {**out, "logprobs": None, "finish_reason": reason}

    def usage(self) -> dict:
        prompt, completion = len(self.runner.session.prompt), len(self.text.tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

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


async def _collect(reply: Reply) -> web.Response:
    pieces = [piece async for piece in text_pieces(reply.runner, reply.text)]
    content, reason = "".join(delta for delta, _ in pieces), pieces[-1][1]
    body = {
        **reply.envelope(chunk=False),
        "choices": [reply.choice(content, reason, chunk=False)],
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
    """Server-sent events: one chunk per durable delta, the reason last, then [DONE]; a
    failure of the session travels as an error event before [DONE]."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    request[_STREAMING] = resp
    head = reply.envelope(chunk=True)
    try:
        if reply.chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            await _send(
                resp, {**head, "choices": [{**first, "logprobs": None, "finish_reason": None}]}
            )
        try:
            async for delta, reason in text_pieces(reply.runner, reply.text):
                extra = {"muser": reply.muser()} if reason else {}
                await _send(resp, {**head, "choices": [reply.choice(delta, reason, True)], **extra})
            if include_usage:
                usage = {"usage": reply.usage(), "muser": reply.muser()}
                await _send(resp, {**head, "choices": [], **usage})
        except ApiError as exc:  # (text_pieces') the status line is gone: an event
            log.error("%s %s: %s", request.method, request.path, exc.message)
            await _send(resp, exc.body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client left session %s mid-stream", reply.runner.session.session_id.hex()[:8])
    return resp


@dataclass(frozen=True)
class Prepared:
    """A request body checked and turned into what its session needs."""

    prompt: list[int]
    params: Any  # SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def prepare(body: dict, api: Api, chat: bool) -> Prepared:
    """Every check of a parsed body and its prompt's tokens (blocking: rendering a chat
    template and tokenizing take milliseconds to seconds; the handlers run it in the app's
    preparing thread). Raises ApiError (4xx) naming the field."""
    check_common(body, api, CHAT if chat else COMPLETIONS)
    prompt = chat_tokens(body, api) if chat else prompt_tokens(body, api)
    default_max = None if chat else COMPLETION_MAX_TOKENS
    params = sampling_params(body, api, len(prompt), default_max)
    stops = stop_strings(body)
    stream = field(body, "stream", bool, False, "a boolean")
    options = field(body, "stream_options", dict, {}, "an object")
    include_usage = field(options, "include_usage", bool, False, "a boolean")
    return Prepared(prompt, params, stops, stream, include_usage)


def chat_tokens(body: dict, api: Api) -> list[int]:
    """The chat request's prompt: messages checked and measured, rendered, tokenized."""
    messages = chat_messages(body)
    check_messages_fit(api, messages)
    return encode_text(api, chat_prompt(api.tokenizer, messages), "messages")


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    api = request.app[API]
    body = await _json_body(request)
    job = await _off_loop(request, prepare, body, api, chat)
    runner = await api.core.start_session(job.prompt, job.params, detached=True)
    reply = Reply(api, chat, runner, TextStream(api.tokenizer, job.stops))
    try:
        if job.stream:
            return await _stream(request, reply, job.include_usage)
        return await _collect(reply)
    finally:  # a stop string, a finished reply or a client gone: nobody reads the rest
        runner.cancel()


# --- handlers and the app -------------------------------------------------------------------


async def _models(request: web.Request) -> web.Response:
    api = request.app[API]
    core = api.core
    card = {
        "id": api.model_id,
        "object": "model",
        "created": api.created,
        "owned_by": "muser",
        "max_model_len": api.context_length,
        "muser": {
            "target_digest": core.target_identity.model_digest,
            "tokenizer_digest": core.target_identity.tokenizer_digest,
            "draft_digest": core.draft_identity.model_digest,
            "vocab_size": core.target_identity.vocab_size,
        },
    }
    return web.json_response({"object": "list", "data": [card]})


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
    are served by the same app."""
    app = web.Application(
        middlewares=[bearer_auth(config.http.secrets()), _errors],  # the key before any work
        client_max_size=config.limits.max_message_bytes,
    )
    app[API] = Api(
        core,
        tokenizer,
        model_id or served_model_id(config.verifier.target),
        config.limits.max_tokens,
        context_length,
        clock,
        int(clock()),
        max_token_bytes(tokenizer),
    )
    pool = ThreadPoolExecutor(1, thread_name_prefix="http-prepare")
    app[PREPARE] = pool

    async def _shutdown(_app: web.Application) -> None:
        pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_shutdown)
    app.add_routes(
        [
            web.get("/v1/models", _models),
            web.post("/v1/completions", _completions),
            web.post("/v1/chat/completions", _chat_completions),
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
