"""API keys on the daemons' HTTP endpoints (the OpenAI-compatible API, /metrics), as
`vllm serve --api-key` takes them: a request carries `Authorization: Bearer KEY`, and KEY
must be one of `http.api_keys` in the cluster file. No keys configured: anyone may call.

    app = web.Application(middlewares=[bearer_auth(keys), ...])

The check runs before any handler, so a refused request reads no body and starts nothing:
401 with an OpenAI-style error naming what was expected, and `WWW-Authenticate: Bearer`.
Keys are compared in constant time and never written anywhere: not in a reply, not in a
log line (the daemons keep no access log), not in `muser config show` (pydantic SecretStr).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

EXPECTED = "expected `Authorization: Bearer <key>` with one of http.api_keys of the cluster file"


def refusal(header: str | None, keys: Sequence[bytes]) -> str | None:
    """Why a request with this Authorization header is refused; None: it may go on."""
    if not keys:
        return None
    if header is None:
        return f"no Authorization header; {EXPECTED}"
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return f"the Authorization header is not a Bearer token; {EXPECTED}"
    given = token.strip().encode()
    # every key compared, each in constant time: neither which key nor how much matched leaks
    if not any([hmac.compare_digest(given, key) for key in keys]):
        return f"the API key is not one of http.api_keys; {EXPECTED}"
    return None


def bearer_auth(keys: Sequence[str], open_paths: frozenset[str] = frozenset()):
    """aiohttp middleware refusing requests without one of `keys` (none: lets all through);
    `open_paths` (a health check) answer anyone."""
    from aiohttp import web

    encoded = [k.encode() for k in keys]

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path in open_paths and request.method in ("GET", "HEAD"):
            return await handler(request)
        why = refusal(request.headers.get("Authorization"), encoded)
        if why is not None:
            error = {"message": why, "type": "authentication_error", "param": None, "code": None}
            return web.json_response(
                {"error": error}, status=401, headers={"WWW-Authenticate": 'Bearer realm="muser"'}
            )
        return await handler(request)

    return check
