"""What the OpenAI-compatible API says about the model it serves and about itself, shaped as
`vllm serve` shapes it: `GET /v1/models` (a card per served name), `POST /tokenize`,
`POST /detokenize`, `GET /version`, `GET /health`.

`/health` answers 200 only while this proposer serves and a verifier of its pool answers
SERVING (a verifier serves only a lane its qualification receipt admits: it refuses to start
otherwise); else 503 with the reason. `/health` and `/version` are open to load balancers;
the rest take the API keys like every other route.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from muser import __version__
from proposer_mac.http_body import API, json_body, off_loop
from proposer_mac.openai_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from proposer_mac.openai_request import (
    ApiError,
    ChatForm,
    chat_messages,
    chat_prompt,
    check_messages_fit,
    check_model,
    check_token_ids,
    encode_text,
    request,
)

OPEN_PATHS = frozenset({"/health", "/version"})
"""Routes that answer without an API key, as vLLM's do: they tell no more than whether the
server is up."""
HEALTH_TIMEOUT_S = 2.0
"""How long /health waits for each verifier's health check."""


def served_model_id(target: Path) -> str:
    """The id clients name by default: the target checkpoint's folder (org/name for a hub
    snapshot)."""
    path = Path(target).resolve()
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--") :].replace("--", "/")
    return path.name


def _api(request: web.Request):
    return request.app[API]


async def models(request: web.Request) -> web.Response:
    api = _api(request)
    core = api.core
    identity = {
        "target_digest": core.target_identity.model_digest,
        "tokenizer_digest": core.target_identity.tokenizer_digest,
        "draft_digest": core.draft_identity.model_digest,
        "vocab_size": core.target_identity.vocab_size,
    }
    cards = [
        {
            "id": name,
            "object": "model",
            "created": api.created,
            "owned_by": "muser",
            "root": api.model_id,
            "parent": None,
            "max_model_len": api.context_length,
            "permission": [],
            "muser": identity,
        }
        for name in api.served_names
    ]
    return web.json_response({"object": "list", "data": cards})


def tokenize(body: dict, api) -> dict:
    """A prompt, or chat messages rendered as /v1/chat/completions renders them, to token ids
    (blocking: the handler runs it in the app's preparing thread)."""
    chat = "messages" in body
    req = request(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    check_model(api, req.model)
    if chat:
        messages = chat_messages(req.messages)
        check_messages_fit(api, messages)
        text = chat_prompt(api.tokenizer, messages, ChatForm.of(req))
        ids = encode_text(api, text, "messages", special=req.add_special_tokens)
    else:
        ids = encode_text(api, req.prompt, "prompt", special=req.add_special_tokens)
    strs = api.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": api.context_length,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(body: dict, api) -> dict:
    req = request(DetokenizeRequest, body)
    check_model(api, req.model)
    check_token_ids(api, req.tokens, "tokens")
    return {"prompt": api.tokenizer.decode(req.tokens)}


async def _tokenize(request_: web.Request) -> web.Response:
    body = await json_body(request_)
    return web.json_response(await off_loop(request_, tokenize, body, _api(request_)))


async def _detokenize(request_: web.Request) -> web.Response:
    body = await json_body(request_)
    return web.json_response(await off_loop(request_, detokenize, body, _api(request_)))


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def unhealthy(core) -> str | None:
    """Why this proposer cannot serve a request now; None: it can."""
    if not core.health.serving:
        faults = "; ".join(f"{k}: {v}" for k, v in sorted(core.health.faults.items()))
        return f"the proposer is NOT_SERVING ({faults})"

    async def ask(member) -> str | None:
        try:
            reply = await health_pb2_grpc.HealthStub(member.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S
            )
        except Exception as exc:  # grpc.aio.AioRpcError, or the channel closing under us
            code = getattr(exc, "code", lambda: None)()
            what = code.name if code is not None else type(exc).__name__
            return f"verifier {member.name} at {member.address} did not answer ({what})"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"verifier {member.name} at {member.address} is NOT_SERVING"
        return None

    members = [core.pool.members[name] for name in core.pool.order]
    reasons = await asyncio.gather(*(ask(m) for m in members))
    if any(r is None for r in reasons):
        return None
    return "no verifier answers SERVING: " + "; ".join(reasons)


async def health(request: web.Request) -> web.Response:
    why = await unhealthy(_api(request).core)
    if why is None:
        return web.Response(status=200)
    raise ApiError(why, status=503, code="unhealthy")


ROUTES = [
    web.get("/v1/models", models),
    web.post("/tokenize", _tokenize),
    web.post("/detokenize", _detokenize),
    web.get("/version", version),
    web.get("/health", health),
]
