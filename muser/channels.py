"""gRPC options of every channel to a daemon and of both daemons' servers: message size and
keepalive (`limits.keepalive_s`, `limits.keepalive_timeout_s`).

Keepalive is how a stream notices a peer that went silent without closing its connection:
a machine that lost power, a cable pulled, a network partition. A killed process is seen at
once (its kernel resets the connection); a silent peer sends nothing, and a stream reading
from it would wait for ever. With keepalive, the side with a stream open pings the other
once the connection has been quiet for `keepalive_s`, and closes the connection when no
answer comes within `keepalive_timeout_s`; every call on it then fails UNAVAILABLE, which
the proposer's round driver and the Generate client answer by reconnecting, as after a
restart.

A round can be long (a restarted verifier re-evaluates a session's transcript before its
first round), so nothing here bounds a call's own duration: a peer that answers pings is
alive, however long its round takes. Servers accept a ping as often as every half
`keepalive_s` (gRPC's default refuses more than one in five minutes without data, and would
close the connection of a client that pings during a long round). `keepalive_s` = 0 leaves
gRPC's defaults: no pings.
"""

from __future__ import annotations

from typing import Protocol


class KeepaliveLimits(Protocol):
    max_message_bytes: int
    keepalive_s: float
    keepalive_timeout_s: float


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _options(limits: KeepaliveLimits, side: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Message size both ways, and with keepalive on, the pings and then `side`'s own."""
    options = [
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_receive_message_length", limits.max_message_bytes),
    ]
    if limits.keepalive_s > 0:
        options += [
            ("grpc.keepalive_time_ms", _ms(limits.keepalive_s)),
            ("grpc.keepalive_timeout_ms", _ms(limits.keepalive_timeout_s)),
            # the wait for any ping's answer; keepalive_timeout_ms alone leaves it at 60 s
            ("grpc.http2.ping_timeout_ms", _ms(limits.keepalive_timeout_s)),
            ("grpc.http2.max_pings_without_data", 0),  # a long round sends no data
            *side,
        ]
    return options


def channel_options(limits: KeepaliveLimits) -> list[tuple[str, int]]:
    """A client's channel: pings while it has a call open and the connection is quiet."""
    # an idle channel needs no liveness
    return _options(limits, [("grpc.keepalive_permit_without_calls", 0)])


def server_options(limits: KeepaliveLimits) -> list[tuple[str, int]]:
    """A daemon's server: pings its clients likewise (a proposer that lost power leaves no
    stream held open at the verifier), and accepts their pings."""
    return _options(
        limits,
        [
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", _ms(limits.keepalive_s / 2)),
            ("grpc.http2.max_ping_strikes", 0),  # 0: never strike a client off
        ],
    )
