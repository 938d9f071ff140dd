"""Fixtures: keys on disk, a cluster config bound to 127.0.0.1:0, a verifier on loopback
with the fake target backend, and a lane client drafting with the fake draft backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cluster_config.schema import (
    ClusterConfig,
    Enrolment,
    Limits,
    ProposerNode,
    VerifierNode,
)
from muser import keys
from muser.records import state_digest
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from tests.core.fake_backend import FakeBackend
from tests.verifier.lane_client import LaneClient, identity_of
from verifier_gx.daemon import create_server

PROMPT = [1, 5, 7, 2]


class CaptureBackend(FakeBackend):
    """The fake backend plus `evaluate_capture`: hidden rows are a pure function of token
    and position, so tests can recompute them."""

    num_layers = 2
    hidden = 3

    def evaluate_capture(self, tokens, layers):
        start = self.length
        logits = self.evaluate(tokens)
        rows = {
            layer: np.array(
                [[layer, start + i, t] for i, t in enumerate(tokens)], dtype=np.float32
            ).reshape(len(tokens), self.hidden)
            for layer in layers
        }
        return logits, rows


@dataclass
class KeySet:
    dir: Path
    verifier: Ed25519PrivateKey
    proposer: Ed25519PrivateKey
    stranger: Ed25519PrivateKey


@pytest.fixture(scope="session")
def key_set(tmp_path_factory) -> KeySet:
    d = tmp_path_factory.mktemp("keys")
    made = {}
    for name in ("verifier", "proposer", "stranger"):
        made[name] = keys.generate()
        keys.write_keypair(made[name], d / f"{name}.key", d / f"{name}.pub")
    return KeySet(d, made["verifier"], made["proposer"], made["stranger"])


def make_config(key_set: KeySet, wal_dir: Path, **limits) -> ClusterConfig:
    d = key_set.dir
    cfg = ClusterConfig(
        verifier=VerifierNode(
            address="127.0.0.1:1",
            key=d / "verifier.key",
            public_key=d / "verifier.pub",
            wal_dir=wal_dir,
            target=d / "no-target",
        ),
        proposer=ProposerNode(
            address="127.0.0.1:2",
            key=d / "proposer.key",
            public_key=d / "proposer.pub",
            wal_dir=wal_dir.parent / "proposer-wal",
            draft=d / "no-draft",
        ),
        enrolment=Enrolment(verifiers=[d / "verifier.pub"], proposers=[d / "proposer.pub"]),
        limits=Limits(**limits),
    )
    # the schema wants a real port; tests bind port 0 and read the one the server got
    verifier = cfg.verifier.model_copy(update={"address": "127.0.0.1:0"})
    return cfg.model_copy(update={"verifier": verifier})


class Verifier:
    """A verifier daemon on loopback, restartable on the same WAL directory."""

    def __init__(self, config: ClusterConfig, key_set: KeySet, backend_factory) -> None:
        self.config, self.key_set, self.backend_factory = config, key_set, backend_factory
        self.server = None
        self.channel = None

    async def start(self) -> Verifier:
        self.backend = self.backend_factory()
        self.server, self.port = create_server(
            self.config, backend=self.backend, unqualified="fake or tiny random target"
        )
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.VerifierStub(self.channel)
        return self

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(None)
        self.server = self.channel = None

    @property
    def manager(self):
        return self.server.manager

    @property
    def wal_seq(self) -> int:
        return self.manager.log.last_seq

    def snapshot(self, session_id: bytes) -> tuple:
        """Everything a refusal must leave unchanged, plus the WAL position."""
        s = self.manager.replay.sessions[session_id]
        return (
            self.wal_seq,
            s.epoch,
            s.head,
            s.next_round,
            tuple(s.transcript),
            state_digest(s.mt),
            s.produced,
            s.done,
            dict(s.committed),
        )

    def client(self, params: SamplingParams, **kw) -> LaneClient:
        kw.setdefault("draft", FakeBackend(order=1, salt=1))
        kw.setdefault("prompt", list(PROMPT))
        kw.setdefault("key", self.key_set.proposer)
        return LaneClient(
            self.stub,
            verifier_public=self.key_set.verifier.public_key(),
            target=identity_of(self.backend),
            params=params,
            **kw,
        )


@pytest_asyncio.fixture
async def verifier(key_set, tmp_path) -> AsyncIterator[Verifier]:
    v = Verifier(make_config(key_set, tmp_path / "wal"), key_set, FakeBackend)
    await v.start()
    yield v
    await v.stop()


@pytest.fixture
def other(tmp_path):
    """A second enrolled verifier's key: another node."""
    private = keys.generate()
    keys.write_keypair(private, tmp_path / "other.key", tmp_path / "other.pub")
    return private, tmp_path / "other"
