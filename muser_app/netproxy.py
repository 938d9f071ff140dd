"""A loopback TCP proxy that can cut every live connection, silence them, part the network
(silence them and answer no new one), and inject a round-trip delay.

Used by the crash tests (cut the proposer↔verifier link mid-stream, or silence it as a
peer that lost power would) and by the bench harness (an injected RTT between the daemons).
It only ever listens on and connects to the addresses it is given, which callers keep on
loopback.
"""

from __future__ import annotations

import asyncio
import threading


class TcpProxy:
    def __init__(
        self, upstream: tuple[str, int], *, listen_host: str = "127.0.0.1", delay_s: float = 0.0
    ) -> None:
        self.upstream, self.listen_host = upstream, listen_host
        self.delay_s = delay_s
        """One-way delay added to each chunk in each direction (RTT = 2 × delay_s)."""
        self.port = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._silenced: set[asyncio.StreamWriter] = set()
        """Writers of silenced connections: what is read for them is dropped."""
        self._parted = False
        """A partition (`partition`): new connections are taken and never answered."""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="tcp-proxy")

    def __enter__(self) -> TcpProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, self.listen_host, 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.delay_s:
            try:
                while data := await reader.read(65536):
                    if writer in self._silenced:
                        continue
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                if writer not in self._silenced:  # a silent peer does not close either
                    writer.close()
            return
        # a link with latency, not a queue: each chunk leaves delay_s after it arrived, in
        # order, however close behind the one before it (sleeping delay_s per chunk would
        # hold the second of two back-to-back messages for twice the delay)
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await chunks.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                chunks.put_nowait((loop.time() + self.delay_s, data))
            chunks.put_nowait(None)
            await sender
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._parted:  # taken, then nothing answers: a host across a partition
            try:
                while await reader.read(65536):
                    pass
            except (ConnectionError, asyncio.CancelledError):
                pass
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except asyncio.CancelledError:  # close(): the connection is aborted there
            return
        self._writers -= {writer, up_writer}
        if writer in self._silenced:  # both ends have given up on it
            self._silenced -= {writer, up_writer}
            writer.close()
            up_writer.close()

    def cut(self) -> int:
        """Reset every live connection (new ones are still accepted); returns how many."""

        def _cut() -> int:
            n = len(self._writers)
            for w in list(self._writers):
                transport = w.transport
                if transport is not None:
                    transport.abort()
            return n

        return self._call(_cut)

    def silence(self) -> int:
        """Make every live connection go silent without closing it: what either end sends
        is dropped, and neither end hears a close from the other, as when a peer loses power
        or the network parts. New connections are forwarded as usual; returns how many were
        silenced. (A connection with an injected delay cannot be silenced.)"""
        if self.delay_s:
            raise ValueError("silence() is for a proxy without delay_s")

        def _silence() -> int:
            self._silenced |= self._writers
            return len(self._writers)

        return self._call(_silence)

    def partition(self) -> int:
        """Part the network: every live connection goes silent (`silence`), and new ones
        are taken but never answered, until `heal`. Returns how many were silenced."""

        def _part() -> int:
            self._parted = True
            self._silenced |= self._writers
            return len(self._writers)

        return self._call(_part)

    def heal(self) -> None:
        """End a partition: new connections are forwarded again (the silenced stay so)."""

        def _heal() -> None:
            self._parted = False

        self._call(_heal)

    def _call(self, fn):
        done = threading.Event()
        box = {}

        def run() -> None:
            box["v"] = fn()
            done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)
        return box.get("v")

    def close(self) -> None:
        if not self._loop.is_running():
            return

        async def shutdown() -> None:
            self._server.close()
            for w in list(self._writers):
                if w.transport is not None:
                    w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
