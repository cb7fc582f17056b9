"""A small asyncio TCP proxy for network-fault tests: added latency, blackhole, connection reset.

Runs its own event loop in a background thread so that synchronous tests can steer it.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from tests.helpers import free_port


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``upstream`` ("host:port")."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self.delay_s = 0.0
        self._flowing = threading.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", 0)).result(timeout=5)
        self.port = int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, coro) -> Future:  # type: ignore[no-untyped-def, type-arg]
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self._flowing.is_set():
                    await asyncio.to_thread(self._flowing.wait)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, up_writer}
        await asyncio.gather(self._pump(client_reader, up_writer), self._pump(up_reader, client_writer))
        self._writers -= {client_writer, up_writer}

    def set_blackhole(self, on: bool) -> None:
        """Stops (or resumes) forwarding while keeping connections open: a hung peer."""
        if on:
            self._flowing.clear()
        else:
            self._flowing.set()

    def retarget(self, upstream: str) -> None:
        """Sends new connections to ``upstream``; open ones stay where they are (a DNS name that
        now resolves to another host, as after a managed Redis failover)."""
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))

    def reset_connections(self) -> None:
        """Closes every open connection (peers see a reset / EOF)."""

        async def close_all() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        self._call(close_all()).result(timeout=5)

    def close(self) -> None:
        self.set_blackhole(False)
        self.reset_connections()
        self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


class ProxyRoutes:
    """A LocalCluster ``route`` that puts a TcpProxy (with ``delay_s`` of latency) on the
    coordinator's links to the given roles; ``proxies[name]`` steers one link."""

    def __init__(self, delay_s: float = 0.0, roles: tuple[str, ...] = ("target",)) -> None:
        self.delay_s = delay_s
        self.roles = roles
        self.proxies: dict[str, TcpProxy] = {}

    def __call__(self, name: str, address: str) -> str:
        if not name.startswith(self.roles):
            return address
        proxy = TcpProxy(address)
        proxy.delay_s = self.delay_s
        self.proxies[name] = proxy
        return proxy.address

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()


class LateLink:
    """A LocalCluster ``route`` that puts a TcpProxy on the coordinator's link to one service
    (``name``: "draft", "target-1", ...) and leads it nowhere (or to ``first``, another server), so
    that the service is unreachable when the coordinator starts, until ``come_up`` sends new
    connections to it. A context manager that closes the proxy."""

    def __init__(self, name: str, first: str = "") -> None:
        self.name = name
        self.first = first
        self.proxy: TcpProxy | None = None
        self._upstream = ""

    def __call__(self, name: str, address: str) -> str:
        if name != self.name:
            return address
        self.proxy, self._upstream = TcpProxy(address), address
        self.proxy.retarget(self.first or f"127.0.0.1:{free_port()}")  # by default nothing listens there
        return self.proxy.address

    @property
    def address(self) -> str:
        """The address the coordinator was given for the service."""
        assert self.proxy is not None, "the cluster has not been started with this route"
        return self.proxy.address

    def come_up(self) -> None:
        assert self.proxy is not None, "the cluster has not been started with this route"
        self.proxy.retarget(self._upstream)
        self.proxy.reset_connections()  # connections to ``first`` end

    def __enter__(self) -> LateLink:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.close()
