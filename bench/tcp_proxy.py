"""A TCP proxy that can cut the line without closing it: a network partition as one process sees
it. While cut, nothing either side sends arrives and nothing tells either end; connections stay
open and new ones are accepted. Once healed, what was sent meanwhile arrives, as TCP's
retransmissions would deliver it, even on a connection whose end gave up waiting and closed it:
a command sent into the partition still runs when the network comes back (the late write a
partitioned worker makes). Used by the partition scenario (``bench/partition.py``) and its test,
with a worker's ``--redis-url`` pointing here instead of at Redis.

    proxy = await CuttableProxy("127.0.0.1", 6379).start()   # proxy.url: redis://127.0.0.1:<port>/0
    proxy.cut(); ...; proxy.heal()
"""

from __future__ import annotations

import asyncio
import contextlib


class CuttableProxy:
    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = 0
        self.held_bytes = 0  # sent by either side while cut (delivered at the heal)
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    async def start(self) -> "CuttableProxy":
        self._server = await asyncio.start_server(self._connected, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def is_cut(self) -> bool:
        return not self._flowing.is_set()

    def cut(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        self.heal()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _connected(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        requests = asyncio.create_task(self._pump(client_reader, upstream_writer))
        replies = asyncio.create_task(self._pump(upstream_reader, client_writer))
        pumps = (requests, replies)
        self._pumps.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            if replies.done():  # Redis closed, or the client is gone: it hears so; what it sent still goes
                client_writer.close()
            await asyncio.gather(requests, return_exceptions=True)
        except asyncio.CancelledError:  # the proxy is closing
            pass
        finally:
            for task in pumps:
                task.cancel()
                self._pumps.discard(task)
            for writer in (client_writer, upstream_writer):
                with contextlib.suppress(Exception):
                    writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bytes one way, held while cut; after the sender's end of file, what it sent still arrives."""
        while data := await reader.read(65536):
            if self.is_cut:
                self.held_bytes += len(data)
                await self._flowing.wait()
            writer.write(data)
            await writer.drain()
        await self._flowing.wait()
