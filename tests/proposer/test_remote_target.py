"""A proposer whose machine does not hold the target's files (verifier.target is the
verifier's path) learns the target's context window from the verifier, so its HTTP API
sizes a chat request without max_tokens to fit, as with the files at hand."""

from __future__ import annotations

import aiohttp
import pytest

from tests.proposer.test_generate_service import start, stop

pytestmark = pytest.mark.asyncio


async def test_the_http_api_takes_the_context_window_the_verifier_reports(key_set, tmp_path):
    """Regression: with no target files here the API knew no context window, defaulted a
    chat request without max_tokens to limits.max_tokens, and the verifier refused that
    open as too long for its context; /v1/models said max_model_len null."""
    c = await start(key_set, tmp_path, ask_identity=True, proposer={"http": "127.0.0.1:0"})
    try:
        window = c.verifier.backend.geometry.context_length
        url = f"http://127.0.0.1:{c.server.http_port}/v1/models"
        async with aiohttp.ClientSession() as http, http.get(url) as reply:
            models = await reply.json()
        assert reply.status == 200
        assert [m["max_model_len"] for m in models["data"]] == [window]
    finally:
        await c.server.http.cleanup()
        await stop(c)
