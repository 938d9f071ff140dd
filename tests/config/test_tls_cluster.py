"""A cluster from `muser config init --tls`, both daemons in process on loopback: the client,
the proposer→verifier link and `muser status` all speak mutual TLS, and the greedy text equals
plain target decode. A client without the cluster's certificates gets nothing."""

from __future__ import annotations

import asyncio

import pytest

from cluster_config import load_config
from cluster_config.rules import check_rules
from muser.cli.cluster_client import stream_generate
from muser.cli.config import init_cluster
from muser.cli.main import main
from muser.cli.status import probe
from muser.sampling import SamplingParams

PROMPT = [5, 17, 42, 9, 100, 3]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.mark.asyncio
async def test_tls_cluster_generates_exactly_and_refuses_plaintext(tmp_path, tiny_pair):
    from proposer_mac import daemon as proposer_daemon
    from verifier_gx import daemon as verifier_daemon
    from verifier_gx.backends import load_target_backend
    from verifier_gx.plain import run_plain

    path = init_cluster(tmp_path / "c", target=tiny_pair[0], draft=tiny_pair[1], tls=True)
    config = load_config(path)
    assert config.tls is not None
    check_rules(config, receipt=False)
    verifier, _ = verifier_daemon.create_server(config, unqualified="tiny random pair, TLS test")
    await verifier.start()
    proposer, _ = await proposer_daemon.create_server(config)
    try:
        got = await asyncio.to_thread(
            stream_generate, config.proposer.address, PROMPT, PARAMS, tls=config.tls
        )
        oracle = run_plain(load_target_backend("torch", tiny_pair[0]), PROMPT, PARAMS).tokens
        assert got["tokens"] == oracle and len(oracle) == PARAMS.max_tokens
        assert await asyncio.to_thread(main, ["status", "--config", str(path)]) == 0
        for role in ("verifier", "proposer"):
            address = getattr(config, role).address
            plaintext = await asyncio.to_thread(probe, address, role, 2.0, None)
            assert not plaintext["serving"] and "UNAVAILABLE" in plaintext["error"]
    finally:
        if getattr(proposer, "http", None) is not None:
            await proposer.http.cleanup()
        await proposer.stop(None)
        proposer.core.log.close()
        await verifier.stop(None)
