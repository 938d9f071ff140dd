"""Request bodies of the HTTP API, read and parsed off the event loop: the app's shared `Api`,
its one preparing thread, and the size limits checked before a byte is parsed."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from proposer_mac.openai_request import Api, ApiError, parse_body

API = web.AppKey("muser_api", Api)

PREPARE = web.AppKey("muser_prepare", ThreadPoolExecutor)
"""One worker thread for a request's heavy work before its session (parsing the body,
rendering the chat template, tokenizing): never on the event loop, which streams every
other client's tokens, and one request at a time, so several huge requests queue there
instead of sharing the interpreter with the loop."""


def _too_large(request: web.Request, size: int | None) -> ApiError:
    limit = request.client_max_size
    got = f"{size} bytes" if size is not None else f"over {limit} bytes"
    return ApiError(
        f"the request body is {got}; this server reads at most "
        f"limits.max_message_bytes = {limit} bytes",
        status=413,
        code="request_too_large",
    )


async def off_loop(request: web.Request, fn, *args):
    """`fn(*args)` in the app's preparing thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[PREPARE], fn, *args)


async def json_body(request: web.Request) -> dict:
    """The body as a JSON object, parsed in the preparing thread; 413 past the size limit."""
    size = request.content_length
    if size is not None and size > request.client_max_size:
        raise _too_large(request, size)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # no Content-Length (chunked): counted as read
        raise _too_large(request, None) from None
    return await off_loop(request, parse_body, raw, request.app[API])
