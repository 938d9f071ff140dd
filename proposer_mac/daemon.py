"""The proposer daemon: client-facing Generate, the draft backend, session recovery.

`create_server(config)` builds the grpc.aio server (service muser.v2.Proposer + health);
on start it replays the journal and resumes every unfinished session, so a client that
reconnects with its session id and a token offset receives the rest without gaps or repeats.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster_config import ClusterConfig
from muser import keys
from muser.errors import MuserError, RefusedError
from muser.records import Identity
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from proposer_mac import journal
from proposer_mac.drafting import Drafter
from proposer_mac.driver import DriverContext, SessionRunner
from proposer_mac.link import channel_options
from proposer_mac.session import ProposerSession

log = logging.getLogger("muser.proposer")


class ProposerCore:
    def __init__(
        self,
        config: ClusterConfig,
        *,
        draft=None,
        target_identity: Identity | None = None,
        tokenizer=None,
    ):
        from wal import FileLog

        self.config = config
        p = config.proposer
        self.private = keys.load_private(p.key)
        self.key_id = keys.key_id(self.private.public_key())
        self.verifiers = {
            keys.key_id(k): k for k in map(keys.load_public, config.enrolment.verifiers)
        }
        if draft is None:
            from proposer_mac.backends import load_draft_backend

            opts = {"device": p.device} if p.backend == "mlx" else {}
            draft = load_draft_backend(p.backend, p.draft, **opts)
        self.draft = draft
        self.draft_identity = _identity(draft.identity)
        self.target_identity = target_identity or _target_identity(config)
        Path(p.wal_dir).mkdir(parents=True, exist_ok=True)
        self.log = FileLog(Path(p.wal_dir) / "journal")
        self.channel = grpc.aio.insecure_channel(
            config.verifier.address, options=channel_options(config.limits.max_message_bytes)
        )
        self.context = DriverContext(
            private=self.private, verifiers=self.verifiers, log=self.log, channel=self.channel
        )
        self.runners: dict[bytes, SessionRunner] = {}
        self._tokenizer = tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.config.proposer.draft))
        return self._tokenizer

    def _runner(self, session: ProposerSession) -> SessionRunner:
        drafter = Drafter(self.draft, session.params, self.config.lane.q_top_k)
        runner = SessionRunner(session, drafter, self.context)
        self.runners[session.session_id] = runner
        return runner

    def recover(self) -> int:
        """Rebuild sessions from the journal; start a runner for each unfinished one."""
        resumed = 0
        for sid, js in journal.replay(r.payload for r in self.log.records()).items():
            session = ProposerSession.from_open(js.open, js.epoch, js.prompt, js.draft_len)
            for signed in js.committed:
                from muser.records import RoundResult

                session.apply(RoundResult.decode(signed.body))
            session.prepared = js.prepared
            session.done = session.done or js.done
            runner = self._runner(session)
            if not session.done:
                runner.start()
                resumed += 1
            log.info(
                "session %s recovered at round %d (%s)",
                sid.hex()[:8],
                session.next_round,
                "done" if session.done else "resuming",
            )
        return resumed

    async def new_session(self, request: pb.GenerateRequest) -> SessionRunner:
        limits = self.config.limits
        params = convert.params_from_pb(request.params)
        if params.max_tokens > limits.max_tokens:
            raise RefusedError(
                f"max_tokens {params.max_tokens} exceeds the cluster limit {limits.max_tokens}"
            )
        prompt = list(request.prompt_tokens) or list(
            self.tokenizer.encode(request.prompt, add_special_tokens=False)
        )
        if not prompt:
            raise RefusedError("the prompt is empty: give prompt text or prompt_tokens")
        vocab = self.target_identity.vocab_size
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise RefusedError(f"prompt token {bad[0]} outside the vocabulary [0, {vocab})")
        draft_len = request.draft_len or self.config.lane.draft_len
        session = ProposerSession.create(
            prompt,
            params,
            self.target_identity,
            self.draft_identity,
            self.key_id,
            draft_len,
            tuple(self.config.lane.capture_layers),
        )
        await self.log.append_async(
            journal.encode_open(session.open, session.epoch, prompt, draft_len)
        )
        await self.context.open_remote(session)
        runner = self._runner(session)
        runner.start()
        return runner


def _identity(i) -> Identity:
    return Identity(i.model_digest, i.tokenizer_digest, i.vocab_size)


def _target_identity(config: ClusterConfig) -> Identity:
    from muser.identity import model_identity

    return _identity(model_identity(config.verifier.target))


class ProposerServicer(pb_grpc.ProposerServicer):
    def __init__(self, core: ProposerCore):
        self.core = core

    async def Generate(self, request: pb.GenerateRequest, context):
        core = self.core
        try:
            if request.session_id:
                runner = core.runners.get(bytes(request.session_id))
                if runner is None:
                    await context.abort(
                        grpc.StatusCode.NOT_FOUND,
                        f"unknown session {bytes(request.session_id).hex()}",
                    )
            else:
                runner = await core.new_session(request)
        except MuserError as exc:
            code = getattr(exc, "code", None)
            if not isinstance(code, grpc.StatusCode):
                code = (
                    grpc.StatusCode.INVALID_ARGUMENT
                    if isinstance(exc, RefusedError)
                    else grpc.StatusCode.INTERNAL
                )
            await context.abort(code, str(exc))
        session = runner.session
        offset = request.offset
        if offset > len(session.emitted) and session.done:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"offset {offset} beyond the {len(session.emitted)} tokens emitted",
            )
        while True:
            try:
                tokens, done = await runner.wait_tokens(offset)
            except MuserError as exc:
                await context.abort(getattr(exc, "code", grpc.StatusCode.INTERNAL), str(exc))
            prefix = core.tokenizer.decode(session.emitted[:offset])
            text = core.tokenizer.decode(session.emitted[: offset + len(tokens)])[len(prefix) :]
            event = pb.GenerateEvent(
                session_id=session.session_id,
                offset=offset,
                tokens=tokens,
                text=text,
                done=done,
                prompt_tokens=len(session.prompt),
            )
            if done:
                event.stats_json = json.dumps(runner.stats.to_dict())
            yield event
            offset += len(tokens)
            if done:
                return

    async def Status(self, request, context):
        core = self.core
        body = {
            "role": "proposer",
            "key_id": core.key_id,
            "sessions": len(core.runners),
            "active": sum(1 for r in core.runners.values() if not r.session.done),
            "draft_device": getattr(core.draft, "device", "cpu"),
            "verifier": core.config.verifier.address,
        }
        return pb.StatusResponse(
            role="proposer", key_id=core.key_id, sessions=len(core.runners), json=json.dumps(body)
        )


async def create_server(config: ClusterConfig, *, draft=None, target_identity=None, tokenizer=None):
    """Build and start the proposer server; returns (server, port). Backends injectable."""
    core = ProposerCore(config, draft=draft, target_identity=target_identity, tokenizer=tokenizer)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", config.limits.max_message_bytes),
            ("grpc.max_send_message_length", config.limits.max_message_bytes),
        ]
    )
    pb_grpc.add_ProposerServicer_to_server(ProposerServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(config.proposer.bind_address)
    if port == 0:
        raise RefusedError(f"cannot bind the proposer address {config.proposer.address}")
    await server.start()
    core.recover()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("muser.v2.Proposer", health_pb2.HealthCheckResponse.SERVING)
    server.core = core  # for tests and status
    return server, port


async def _serve(config: ClusterConfig) -> None:
    server, port = await create_server(config)
    host = config.proposer.bind_address.rpartition(":")[0]
    print(
        f"proposer listening on {host}:{port} key={server.core.key_id}", file=sys.stderr, flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
    server.core.log.close()


def serve(config: ClusterConfig) -> None:
    # The round's path hops between the event loop, the draft/compute thread and the WAL
    # flusher; CPython's default 5 ms GIL switch interval would let a busy thread hold
    # the loop off that long at each hop.
    sys.setswitchinterval(0.0005)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(config))
