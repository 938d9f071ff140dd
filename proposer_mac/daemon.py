"""The proposer daemon: `create_server(config)` builds the grpc.aio server around a
`ProposerCore` (service muser.v2.Proposer, served by `proposer_mac.servicer`, + health, and
the OpenAI-compatible API when `proposer.http` is set); `serve` runs it until a signal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2_grpc

from cluster_config import ClusterConfig
from muser import heap, threads, tls
from muser.affinity import serving
from muser.channels import refuse_malformed, server_options
from muser.errors import RefusedError
from muser.metrics import metrics_route
from muser.records import Identity
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from proposer_mac.core import ProposerCore
from proposer_mac.servicer import ProposerServicer, metrics_view

log = logging.getLogger("muser.proposer")


async def ask_target_identity(core: ProposerCore, timeout: float = 60.0) -> Identity:
    """The target's identity as the verifier reports it, for a proposer on another machine
    than the target's files. Nothing is taken on trust: the verifier refuses any session
    open that names an identity other than its loaded target's, and signs every result."""
    address = core.config.verifier.address
    log.info("verifier.target is not on this machine: asking the verifier at %s", address)
    try:
        reply = await core.pool.members[core.pool.current].stub.Status(
            pb.StatusRequest(), timeout=timeout, wait_for_ready=True
        )
        t = json.loads(reply.json)["target"]
        ident = Identity(t["model_digest"], t["tokenizer_digest"], int(t["vocab_size"]))
        context = t.get("context_length")  # (absent from a verifier before it reported one)
        core.target_context_length = None if context is None else int(context)
    except grpc.aio.AioRpcError as exc:
        raise RefusedError(
            f"the target's files are not at verifier.target ({core.config.verifier.target}) "
            f"and the verifier at {address} did not report its identity: {exc.code().name}: "
            f"{exc.details()}; start the verifier first, or put the target checkpoint there"
        ) from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise RefusedError(f"the verifier at {address} reported no usable target: {exc}") from exc
    if ident.tokenizer_digest != core.draft_identity.tokenizer_digest:
        raise RefusedError(
            f"the verifier's target vocabulary {ident.tokenizer_digest} differs from the "
            f"draft's {core.draft_identity.tokenizer_digest} ({core.config.proposer.draft}): "
            "the pair must share one vocabulary (a proposer without the target's files can "
            "compare digests only; put the target's tokenizer at verifier.target to compare "
            "them token by token)"
        )
    return ident


async def create_server(
    config: ClusterConfig,
    *,
    draft=None,
    target_identity=None,
    tokenizer=None,
    http_routes=(),
    identity_timeout: float = 60.0,
):
    """Build and start the proposer server; returns (server, port). Backends injectable.

    With `proposer.http` set, the OpenAI-compatible API (plus `http_routes`) is served on
    the same loop: `server.http` is its aiohttp runner, `server.http_port` its bound port."""
    core = ProposerCore(config, draft=draft, target_identity=target_identity, tokenizer=tokenizer)
    if core.target_identity is None:
        core.target_identity = await ask_target_identity(core, identity_timeout)
        core.check_draft_target()
    server = grpc.aio.server(
        interceptors=[refuse_malformed()], options=server_options(config.limits)
    )
    pb_grpc.add_ProposerServicer_to_server(ProposerServicer(core), server)
    health_pb2_grpc.add_HealthServicer_to_server(core.health.servicer, server)
    port = tls.add_port(server, config.proposer.bind_address, config.tls, "proposer")
    if port == 0:
        raise RefusedError(f"cannot bind the proposer address {config.proposer.address}")
    await server.start()
    core.recover()
    await core.health.start()
    core.watch()
    server.core = core  # for tests and status
    server.http, server.http_port = None, None
    if config.proposer.http:
        try:
            server.http, server.http_port = await _start_http(
                core, config, (*http_routes, metrics_route(lambda: metrics_view(core)))
            )
        except RefusedError:
            await server.stop(None)
            raise
    return server, port


async def _start_http(core: ProposerCore, config: ClusterConfig, routes):
    """The OpenAI-compatible API at proposer.http; returns (aiohttp runner, bound port)."""
    from proposer_mac import http_api

    app = http_api.create_app(
        core,
        config,
        core.tokenizer,
        context_length=core.target_context_length,
        extra_routes=routes,
    )
    context = tls.http_ssl_context(config.tls, "proposer")  # HTTPS under [tls]
    return await http_api.serve_http(app, config.proposer.http, context)


async def _serve(config: ClusterConfig) -> None:
    threads.start_default_executor()  # the thread count is level from here (muser.threads)
    server, port = await create_server(config)
    heap.serving_heap()  # the draft and the resumed sessions live as long as the process
    host = config.proposer.bind_address.rpartition(":")[0]
    if server.http is not None:
        http_host = config.proposer.http.rpartition(":")[0]
        scheme = "https" if config.tls else "http"
        print(f"proposer http API on {scheme}://{http_host}:{server.http_port}/v1", file=sys.stderr)
    print(
        f"proposer listening on {host}:{port} key={server.core.key_id}", file=sys.stderr, flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if server.http is not None:
        await server.http.cleanup()
    await server.stop(grace=1.0)
    await server.core.close()


def serve(config: ClusterConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with serving(config.proposer.cpus, "proposer.cpus", log):
        asyncio.run(_serve(config))
