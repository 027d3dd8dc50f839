"""TCP forwarders on loopback: what kube-proxy does for a Service, for the local cluster's host.

Each forwarder listens on 127.0.0.1 at a free port and hands every accepted connection to one of its
current backends (round robin, as kube-proxy's userspace mode did), piping bytes both ways until either
side closes, so HTTP keep-alive and SSE streams pass through untouched. With no backend a connection is
closed at once (a Service without ready endpoints refuses too). Backends change at any time; connections
already open keep theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Sequence

Backend = tuple[str, int]


class Forwarders:
    """Named forwarders served by one asyncio loop in a daemon thread. Thread-safe."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="forwarders", daemon=True)
        self._thread.start()
        self._servers: dict[str, asyncio.Server] = {}
        self._backends: dict[str, list[Backend]] = {}
        self._turn = itertools.count()
        self._streams: set[asyncio.StreamWriter] = set()

    def ports(self) -> dict[str, int]:
        """The listening port of each open forwarder, by name."""
        return {name: server.sockets[0].getsockname()[1] for name, server in self._servers.items()}

    def expose(self, name: str, backends: Sequence[Backend]) -> int:
        """Set the backends of forwarder `name`, opening it on a free port first if needed; its port."""
        self._backends[name] = list(backends)
        if name not in self._servers:
            self._servers[name] = self._call(self._listen(name))
        return self._servers[name].sockets[0].getsockname()[1]

    def close(self, name: str) -> None:
        """Stop listening for `name` and drop its open connections."""
        self._backends.pop(name, None)
        server = self._servers.pop(name, None)
        if server is not None:
            self._call(self._close_server(server))

    def stop(self) -> None:
        """Close every forwarder and stop the loop's thread."""
        for name in list(self._servers):
            self.close(name)
        self._call(self._close_streams())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _listen(self, name: str) -> asyncio.Server:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._forward(name, reader, writer)

        return await asyncio.start_server(accept, "127.0.0.1", 0)

    async def _close_server(self, server: asyncio.Server) -> None:
        server.close()
        # Open connections would keep wait_closed() waiting; a deleted Service drops them too.
        if hasattr(server, "close_clients"):
            server.close_clients()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5)

    async def _close_streams(self) -> None:
        for writer in list(self._streams):
            writer.close()

    async def _forward(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backends = self._backends.get(name) or []
        if not backends:
            writer.close()
            return
        host, port = backends[next(self._turn) % len(backends)]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        self._streams.update((writer, upstream_writer))
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            self._streams.difference_update((writer, upstream_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF or a reset, then close `writer`: when one side goes, the connection goes (HTTP
    needs no half-closed connections)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
