"""The proposer's verifier pool: the [verifier] and each [[pool]] verifier of the cluster
file, one channel to each, and where new sessions open.

A session lives on one verifier at a time (its home, journaled MOVED). When its home stays
unreachable past `proposer.failover_s`, or refuses it as fenced, the driver moves it to
the next verifier of the pool (`next_after`) at a higher epoch; new sessions then open
there first (`current`). Without a [[pool]] the pool has one verifier and nothing moves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from cluster_config import ClusterConfig
from muser import keys, tls
from muser.channels import channel_options
from muser.wire import muser_v2_pb2_grpc as pb_grpc

log = logging.getLogger("muser.proposer")


@dataclass
class Member:
    """One verifier of the pool."""

    name: str
    address: str
    key_id: str
    """The key it must answer opens with and sign results with (its enrolled public key)."""
    channel: grpc.aio.Channel
    stub: pb_grpc.VerifierStub


class VerifierPool:
    def __init__(self, members: list[Member], failover_s: float = 5.0):
        if not members:
            raise ValueError("a verifier pool needs at least one verifier")
        self.members = {m.name: m for m in members}
        self.order = [m.name for m in members]
        self.failover_s = failover_s
        self.current = self.order[0]
        """Where new sessions open first: the verifier a session last moved to."""
        self.moves = 0
        """Sessions moved to another verifier since the daemon started."""
        self.fences = 0
        """Verifiers a session left told its new epoch (they refuse the old one)."""
        self.fragment_bytes = 0
        """Fragment bytes sent to verifiers (opens and missing_fragments answers): what a
        verifier's fragment store saves shows here."""

    @classmethod
    def from_config(cls, config: ClusterConfig) -> VerifierPool:
        """One channel per verifier of `config` ([verifier], then each [[pool]] one)."""
        publics = [config.verifier.public_key, *(v.public_key for v in config.pool)]
        options = [
            *channel_options(config.limits),
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if config.pool:  # a connect left unanswered (a partition) gives up within ~failover_s,
            # not gRPC's 20 s, so a verifier a session left is reached soon after it heals
            options.append(
                ("grpc.min_reconnect_backoff_ms", max(1000, int(1e3 * config.proposer.failover_s)))
            )
        members = []
        for (name, address), public in zip(config.verifiers(), publics, strict=True):
            channel = tls.open_channel(address, config.tls, "proposer", options=options, aio=True)
            key_id = keys.key_id(keys.load_public(public))
            members.append(Member(name, address, key_id, channel, pb_grpc.VerifierStub(channel)))
        return cls(members, config.proposer.failover_s)

    @property
    def pooled(self) -> bool:
        """More than one verifier: sessions may move."""
        return len(self.order) > 1

    def member(self, name: str | None) -> Member | None:
        """The verifier named `name`; None for one the cluster file no longer lists."""
        return self.members.get(name) if name is not None else None

    def home_of(self, name: str | None) -> Member:
        """Where a session journaled on `name` lives: that verifier, or (a session journaled
        before pools, None) the first."""
        return self.members[name or self.order[0]]

    def next_after(self, name: str | None) -> Member:
        """The verifier a session on `name` moves to: the next in the pool's order, round
        the end; for a verifier no longer listed, the one new sessions open on."""
        if name not in self.members:
            return self.members[self.current]
        return self.members[self.order[(self.order.index(name) + 1) % len(self.order)]]

    def moved_to(self, name: str) -> None:
        """A session moved to `name`: count it, and open new sessions there first."""
        self.moves += 1
        self.current = name

    async def close(self) -> None:
        for m in self.members.values():
            await m.channel.close()
