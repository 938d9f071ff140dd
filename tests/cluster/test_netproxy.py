"""The loopback proxy forwards bytes, adds its delay and cuts live connections."""

import socket
import socketserver
import threading
import time

import pytest

from muser_app.netproxy import TcpProxy


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def echo_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address
    server.shutdown()
    server.server_close()


def round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(4096)


def test_forwards_and_delays(echo_server):
    with TcpProxy(echo_server, delay_s=0.02) as proxy:
        start = time.perf_counter()
        assert round_trip(proxy.port, b"hello") == b"hello"
        assert time.perf_counter() - start >= 0.04  # two one-way delays


def test_back_to_back_messages_are_each_delayed_once_in_order(echo_server):
    """A link with latency, not a queue: the second of two messages sent close together
    arrives about when the first does, not one delay later."""
    delay = 0.05
    with (
        TcpProxy(echo_server, delay_s=delay) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s,
    ):
        start = time.perf_counter()
        s.sendall(b"first.")
        time.sleep(0.005)
        s.sendall(b"second")
        got = b""
        while len(got) < 12:
            got += s.recv(64)
        elapsed = time.perf_counter() - start
    assert got == b"first.second"
    assert 2 * delay <= elapsed < 3 * delay  # a queue would take 4 delays for the second


def test_cut_resets_live_connections_and_new_ones_work(echo_server):
    with TcpProxy(echo_server) as proxy:
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        s.sendall(b"a")
        assert s.recv(10) == b"a"
        assert proxy.cut() == 2  # client side and upstream side
        s.settimeout(5)
        try:
            got = s.recv(10)
        except ConnectionResetError:
            got = b""
        assert got == b""
        s.close()
        assert round_trip(proxy.port, b"again") == b"again"
