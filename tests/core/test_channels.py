"""gRPC keepalive (`muser.channels`): a peer gone silent is noticed by either side, through
a real grpc.aio server and channel whose connection a proxy silences."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cluster_config.schema import Limits
from muser.channels import channel_options, server_options
from muser_app.netproxy import TcpProxy

QUICK = Limits(keepalive_s=0.3, keepalive_timeout_s=0.3)
OFF = Limits(keepalive_s=0)
METHOD = "/test.Silence/Watch"


def test_defaults_ping_after_ten_quiet_seconds():
    options = dict(channel_options(Limits()))
    assert options["grpc.keepalive_time_ms"] == 10_000
    assert options["grpc.keepalive_timeout_ms"] == 10_000
    assert options["grpc.http2.ping_timeout_ms"] == 10_000
    served = dict(server_options(Limits()))
    assert served["grpc.keepalive_time_ms"] == 10_000
    assert served["grpc.http2.min_recv_ping_interval_without_data_ms"] == 5_000  # half: a
    # client that pings at keepalive_s is never a strike


def test_zero_leaves_grpc_without_pings():
    sizes = {"grpc.max_send_message_length", "grpc.max_receive_message_length"}
    assert {k for k, _ in channel_options(OFF)} == sizes
    assert {k for k, _ in server_options(OFF)} == sizes
    assert dict(channel_options(OFF))["grpc.max_send_message_length"] == OFF.max_message_bytes


@pytest.mark.parametrize(
    "field, value", [("keepalive_s", -1.0), ("keepalive_timeout_s", 0.0)], ids=["neg", "zero"]
)
def test_out_of_range_keepalive_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})


async def _silenced_stream(server_limits: Limits, client_limits: Limits, wait_s: float):
    """A server-streaming call that sends one message and then nothing, through a proxy
    silenced after that message. Returns (the client's status or None if the call was still
    open after `wait_s`, seconds until then, whether the server saw its call end)."""
    ended = asyncio.Event()

    async def watch(request, context):
        try:
            yield b"first"
            await asyncio.Event().wait()  # nothing more, ever
        finally:
            ended.set()

    handler = grpc.method_handlers_generic_handler(
        "test.Silence", {"Watch": grpc.unary_stream_rpc_method_handler(watch)}
    )
    server = grpc.aio.server(options=server_options(server_limits))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proxy = TcpProxy(("127.0.0.1", port))
    proxy.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{proxy.port}", options=channel_options(client_limits)
        ) as channel:
            call = channel.unary_stream(METHOD)(b"")
            assert await call.read() == b"first"
            assert proxy.silence() == 2  # the client's side and the server's
            began = time.monotonic()
            try:
                code = None
                await asyncio.wait_for(call.read(), wait_s)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            except TimeoutError:
                call.cancel()
            took = time.monotonic() - began
            await asyncio.sleep(0)
            server_saw = ended.is_set()
    finally:
        proxy.close()
        await server.stop(None)
    return code, took, server_saw


def test_a_client_notices_a_silent_server():
    code, took, _ = asyncio.run(_silenced_stream(OFF, QUICK, wait_s=10))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert took < 5  # a ping after 0.3 s quiet, unanswered for 0.3 s (not gRPC's 60 s)


def test_a_server_notices_a_silent_client():
    code, _, server_saw = asyncio.run(_silenced_stream(QUICK, OFF, wait_s=5))
    assert code is None  # the client, without keepalive, still waits
    assert server_saw  # while the server has dropped the call


def test_without_keepalive_nobody_notices():
    code, _, server_saw = asyncio.run(_silenced_stream(OFF, OFF, wait_s=3))
    assert code is None and not server_saw


def test_a_silenced_proxy_refuses_a_delay():
    with TcpProxy(("127.0.0.1", 9), delay_s=0.01) as proxy, pytest.raises(ValueError):
        proxy.silence()
