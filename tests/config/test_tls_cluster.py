"""A cluster from `muser config init --tls`, both daemons in process on loopback: the client,
the proposer→verifier link and `muser status` all speak mutual TLS, and the greedy text equals
plain target decode. A client without the cluster's certificates gets nothing."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request

import pytest

from cluster_config import load_config
from muser.sampling import SamplingParams
from muser_app.checks import check_config
from muser_app.cli.cluster_client import stream_generate
from muser_app.cli.config import init_cluster
from muser_app.cli.main import main
from muser_app.cli.status import probe
from tests.cluster.harness import stop_in_process

PROMPT = [5, 17, 42, 9, 100, 3]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.mark.asyncio
async def test_tls_cluster_generates_exactly_and_refuses_plaintext(tmp_path, tiny_pair):
    from muser_app.lanes.plain import run_plain
    from proposer_mac import daemon as proposer_daemon
    from verifier_gx import daemon as verifier_daemon
    from verifier_gx.backends import load_target_backend

    path = init_cluster(tmp_path / "c", target=tiny_pair[0], draft=tiny_pair[1], tls=True)
    config = load_config(path)
    assert config.tls is not None
    check_config(config, receipt=False)
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
        # the HTTP API and /metrics: HTTPS with the proposer's certificate, checked against
        # the cluster CA; plain HTTP gets no answer
        http = f"127.0.0.1:{proposer.http_port}"
        for path in ("/v1/models", "/metrics"):
            status, body = await asyncio.to_thread(https_get, f"https://{http}{path}", config)
            assert status == 200 and body
        with pytest.raises(OSError):
            await asyncio.to_thread(urllib.request.urlopen, f"http://{http}/metrics", timeout=5)
    finally:
        await stop_in_process(proposer, verifier)


def https_get(url: str, config) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(config.tls.ca))
    with urllib.request.urlopen(url, context=context, timeout=10) as reply:
        return reply.status, reply.read()


@pytest.mark.asyncio
async def test_verifier_metrics_serve_https_under_tls(tmp_path, tiny_pair):
    """serve_metrics with the verifier's context (what `muser verifier serve` passes under
    [tls]): a client that trusts the CA reads it; one that does not is refused."""
    from muser.metrics import DaemonView, serve_metrics
    from muser.stats import VerifierStats
    from muser.tls import http_ssl_context

    path = init_cluster(tmp_path / "c", target=tiny_pair[0], draft=tiny_pair[1], tls=True)
    config = load_config(path)
    stats = VerifierStats()
    view = DaemonView("verifier", "k", stats, stats, 0, 0, None, stats.clock())
    runner, port = await serve_metrics(
        "127.0.0.1:0", lambda: view, http_ssl_context(config.tls, "verifier")
    )
    try:
        url = f"https://127.0.0.1:{port}/metrics"
        status, body = await asyncio.to_thread(https_get, url, config)
        assert status == 200 and b"muser_info" in body
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            await asyncio.to_thread(urllib.request.urlopen, url, timeout=5)  # CA not trusted
    finally:
        await runner.cleanup()
    assert http_ssl_context(None, "verifier") is None  # no [tls]: plain HTTP


def test_a_certificate_that_does_not_fit_its_key_is_named(tmp_path, tiny_pair):
    from muser.tls import TlsError, http_ssl_context

    path = init_cluster(tmp_path / "c", target=tiny_pair[0], draft=tiny_pair[1], tls=True)
    config = load_config(path)
    pair = config.tls.pair("verifier")
    pair.key.write_bytes(config.tls.pair("proposer").key.read_bytes())
    with pytest.raises(TlsError, match="tls.verifier: cannot load"):
        http_ssl_context(config.tls, "verifier")
