"""A proposer daemon started again on a cluster's journal, beside its verifier: what the
restart tests of several files share."""

from __future__ import annotations

import contextlib

from proposer_mac.daemon import create_server
from tests.core.fake_backend import FakeBackend
from tests.proposer.test_generate_service import CharTokenizer
from tests.verifier.lane_client import identity_of


@contextlib.asynccontextmanager
async def proposer_again(config, c, draft=None):
    """A proposer daemon on `config` (its journal: the one before it stopped) and `c`'s
    verifier, drafting with `draft` (default: the tests' order-1 fake); yields its core."""
    server, _ = await create_server(
        config,
        draft=draft or FakeBackend(order=1, salt=1),
        target_identity=identity_of(c.verifier.backend),
        tokenizer=CharTokenizer(),
    )
    try:
        yield server.core
    finally:
        await server.stop(None)
        await server.core.close()
