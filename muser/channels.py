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


class _Malformed:
    """What a request that did not parse becomes, so its handler can refuse it clearly."""

    def __init__(self, method: str, exc: Exception) -> None:
        self.why = f"{method}: the message does not parse as its protobuf type ({exc})"


def refuse_malformed():
    """A server interceptor: a request message that does not parse gets INVALID_ARGUMENT
    naming the method, not gRPC's UNKNOWN with a traceback in the daemon's log (its
    deserializer runs before any handler). Every daemon server installs it. A request
    stream's messages are parsed as its servicer reads them, which then sees the
    DecodeError and answers it (the verifier's Rounds)."""
    import grpc

    async def refuse(context, request) -> None:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)

    class RefuseMalformed(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            if handler is None or handler.request_deserializer is None:
                return handler
            parse, method = handler.request_deserializer, details.method

            def tolerant(data: bytes):
                try:
                    return parse(data)
                except Exception as exc:  # DecodeError, or anything a parser raises
                    return _Malformed(method, exc)

            out = handler.response_serializer
            if handler.unary_unary is not None:
                inner_uu = handler.unary_unary

                async def unary_unary(request, context):
                    await refuse(context, request)
                    return await inner_uu(request, context)

                return grpc.unary_unary_rpc_method_handler(unary_unary, tolerant, out)
            if handler.unary_stream is not None:
                inner_us = handler.unary_stream

                async def unary_stream(request, context):
                    await refuse(context, request)
                    async for reply in inner_us(request, context):
                        yield reply

                return grpc.unary_stream_rpc_method_handler(unary_stream, tolerant, out)
            return handler  # a request stream: its servicer reads DecodeError from it

    return RefuseMalformed()
