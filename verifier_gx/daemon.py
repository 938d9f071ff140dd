"""The verifier daemon: build the gRPC server from the cluster file, run it until a signal.

    server, port = create_server(config)        # recovers the commit log first
    await server.start()                        # health: SERVING
    ...
    await server.stop(grace)                    # stops RPCs, then closes the commit log

Layout under `verifier.wal_dir`: `commit/` is the commit log (wal.log.FileLog, one writer,
flock'd); `fragments/` the durable fragment store (wal.fragments.FileFragmentStore): what
proposers sent, kept across restarts so they send digests, not bytes, for it again
(verifier_gx.fragments; a fragment it lacks is re-requested with `missing_fragments`).

Health (muser.health): a commit log that failed a write or an fsync refuses every append
from then on, and the daemon answers NOT_SERVING with the reason until it is restarted.
It does not reopen the log itself: its sessions' heads live in memory beside the log, and
after a failed fsync the file may read back records the disk never got, so the one safe
reopen is the start's recovery, which rebuilds both from what is on disk. Opens and rounds
meanwhile are refused UNAVAILABLE, so proposers keep retrying and carry on from the last
durable round once it is back. A target forward that raises reports the target
NOT_SERVING until a forward succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2_grpc

from cluster_config import qualification
from cluster_config.schema import ClusterConfig, ConfigError
from muser import heap, keys, threads, tls
from muser.affinity import serving
from muser.backend import ModelBackend
from muser.channels import refuse_malformed, server_options
from muser.errors import RefusedError
from muser.health import Health
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from verifier_gx.servicer import VerifierServicer
from verifier_gx.sessions import SessionManager
from wal.fragments import FileFragmentStore
from wal.log import FileLog

log = logging.getLogger("muser.verifier")
SERVICE = "muser.v2.Verifier"


def wal_fault(why: object) -> str:
    """The `wal` fault's reason: what failed, and the operator's remedy."""
    return (
        f"the commit log failed: {why}; restart the verifier once its disk takes writes "
        "again: it recovers the commit log at start, and sessions resume from their last "
        "durable round"
    )


class VerifierServer(grpc.aio.Server):
    """A grpc.aio server that owns the session manager and the commit log it writes."""

    def __init__(self, inner: grpc.aio.Server, manager: SessionManager, health: Health) -> None:
        self._inner = inner
        self.manager = manager
        self.health = health
        self._expiry: asyncio.Task | None = None
        """Closes idle sessions (limits.session_idle_s) while the server runs."""

    @property
    def key_id(self) -> str:
        return self.manager.key_id

    def add_generic_rpc_handlers(self, generic_rpc_handlers) -> None:
        self._inner.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self._inner.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._inner.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials) -> int:
        return self._inner.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        await self._inner.start()
        await self.health.start()
        self._expiry = asyncio.ensure_future(self.manager.expire_idle())

    async def stop(self, grace: float | None) -> None:
        await self.health.stop()
        if self._expiry is not None:
            self._expiry.cancel()
        await self._inner.stop(grace)
        await self.manager.compactor.close()
        self.manager.log.close()
        if self.manager.fragments.store is not None:
            self.manager.fragments.store.close()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self._inner.wait_for_termination(timeout)

    def not_serving(self, exc: BaseException) -> None:
        """A round or an open met a failed commit log: NOT_SERVING until a restart recovers
        it (the log has usually said so first, naming the write or fsync that failed)."""
        if self.health.reason("wal") is None:
            self.health.fault("wal", wal_fault(exc))


def load_keys(config: ClusterConfig):
    """The verifier's signing key (checked against its public key file), the enrolled
    proposer keys and the enrolled verifier keys (resume points they signed are taken), by
    key id."""
    private = keys.load_private(config.verifier.key)
    public = keys.load_public(config.verifier.public_key)
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    if private.public_key().public_bytes(*raw) != public.public_bytes(*raw):
        raise ConfigError(
            f"verifier.public_key {config.verifier.public_key} (key {keys.key_id(public)}) is "
            f"not the public half of verifier.key {config.verifier.key} "
            f"(key {keys.key_id(private.public_key())})"
        )
    proposers = {keys.key_id(k): k for k in map(keys.load_public, config.enrolment.proposers)}
    verifiers = {keys.key_id(k): k for k in map(keys.load_public, config.enrolment.verifiers)}
    return keys.Signer(private), proposers, verifiers


def create_server(
    config: ClusterConfig,
    *,
    backend: ModelBackend | None = None,
    clock: Callable[[], float] = time.monotonic,
    unqualified: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Recover the commit log and build the (not yet started) server bound to
    verifier.bind_address (default: verifier.address); returns it and the bound port.
    Call from inside the event loop that will run it.

    A lane without a matching qualification receipt (lane.receipt) is refused with
    QualificationError before the target loads and before the port is bound (docs/design.md §8).
    `unqualified="why"` skips that check, logged as a warning: tests that drive a fake or
    tiny random target pass it; `serve` never does."""
    private, proposers, verifiers = load_keys(config)
    qualified_draft = qualified_capture = None
    if unqualified is None:
        qualified_draft, qualified_capture = _qualified_lane(config)
    else:
        log.warning("serving an UNQUALIFIED lane (no receipt checked): %s", unqualified)
    if backend is None:
        from verifier_gx.backends import load_target_backend, target_options

        backend = load_target_backend(
            config.verifier.backend,
            config.verifier.target,
            **target_options(config.verifier),
        )
    health = Health(SERVICE)
    commit_log = FileLog(
        Path(config.verifier.wal_dir) / "commit",
        on_failure=lambda why: health.fault("wal", wal_fault(why)),
    )
    store = None
    try:
        store = FileFragmentStore(Path(config.verifier.wal_dir) / "fragments")
        manager = SessionManager(
            log=commit_log,
            backend=backend,
            signing_key=private,
            proposer_keys=proposers,
            verifier_keys=verifiers,
            limits=config.limits,
            clock=clock,
            qualified_draft=qualified_draft,
            qualified_capture=qualified_capture,
            max_decode_len=config.lane.decode_len,
            max_drafts=config.lane.draft_len_max,
            max_tree_nodes=config.lane.tree_nodes,
            compact_bytes=config.verifier.commit_compact_bytes,
            health=health,
            fragment_store=store,
        )
        commit_log.on_fsync = manager.stats.observe_fsync
        inner = grpc.aio.server(
            interceptors=[refuse_malformed()],
            options=[
                *server_options(config.limits),
                ("grpc.so_reuseport", 0),  # a second daemon on a taken port fails to bind
            ],
        )
        server = VerifierServer(inner, manager, health)  # health answers from start()
        servicer = VerifierServicer(manager, on_fatal=server.not_serving)
        pb_grpc.add_VerifierServicer_to_server(servicer, inner)
        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, inner)
        try:
            port = tls.add_port(inner, config.verifier.bind_address, config.tls, "verifier")
        except RuntimeError as exc:
            raise ConfigError(
                f"cannot bind verifier.bind_address {config.verifier.bind_address!r}: {exc}"
            ) from exc
    except BaseException:
        commit_log.close()
        if store is not None:
            store.close()
        raise
    if commit_log.last_seq:
        log.info(
            "recovered %d sessions (%d closed) from %d commit records",
            len(manager.replay.sessions),
            len(manager.replay.closed),
            commit_log.last_seq,
        )
    return server, port


def _qualified_lane(config: ClusterConfig) -> tuple[tuple[str, str], tuple[int, ...]]:
    """The (model, tokenizer) digests of the draft the lane's receipt qualified, and the
    capture layers it qualified its sessions with; refuses (QualificationError) without a
    matching receipt."""
    binding = qualification.require_receipt(config).binding
    draft = binding.draft
    return (draft.model_digest, draft.tokenizer_digest), tuple(binding.lane["capture_layers"])


async def _serve(config: ClusterConfig) -> None:
    threads.start_default_executor()  # the thread count is level from here (muser.threads)
    server, port = create_server(config)
    heap.serving_heap()  # the target and the recovered sessions live as long as the process
    await server.start()
    host = config.verifier.bind_address.rpartition(":")[0]
    http = None
    if config.verifier.http:
        from muser.metrics import serve_metrics
        from verifier_gx.servicer import metrics_view

        try:
            http, http_port = await serve_metrics(
                config.verifier.http,
                lambda: metrics_view(server.manager),
                tls.http_ssl_context(config.tls, "verifier"),  # HTTPS under [tls]
                config.http.secrets(),
            )
        except RefusedError as exc:
            await server.stop(None)
            raise ConfigError(f"verifier.http: {exc}") from exc
        http_host = config.verifier.http.rpartition(":")[0]
        scheme = "https" if config.tls else "http"
        print(f"verifier metrics on {scheme}://{http_host}:{http_port}/metrics", file=sys.stderr)
    print(f"verifier listening on {host}:{port} key={server.key_id}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received; stopping")
    if http is not None:
        await http.cleanup()
    await server.stop(5.0)


def serve(config: ClusterConfig) -> None:
    """Run the verifier until SIGTERM/SIGINT, then stop RPCs and close the commit log."""
    with serving(config.verifier.cpus, "verifier.cpus", log):
        asyncio.run(_serve(config))
