"""A loopback TCP forwarder for outage tests: clients connect to `proxy.port`, bytes go to the
real server (PostgreSQL, a broker) and back. `cut()` drops every open connection and refuses new
ones, as a server gone away looks to its clients; `restore()` listens again on the same port.

The real server keeps running for every other test: only the connections through the proxy see
the outage."""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class TcpProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy-accept").start()

    def cut(self) -> None:
        """Refuse new connections and reset every open one."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(), which holds the port
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut while connecting
                    client.close()
                    server.close()
                    return
                self._open.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True, name="tcp-proxy-pump").start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._open.discard(source)
            source.close()
