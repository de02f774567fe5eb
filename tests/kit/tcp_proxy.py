"""A loopback TCP forwarder for outage tests: clients connect to `proxy.port`, bytes go to the
real server (PostgreSQL, a broker) and back. `cut()` drops every open connection and refuses new
ones, as a server gone away looks to its clients; `restore()` listens again on the same port.

The real server keeps running for every other test: only the connections through the proxy see
the outage.

`delay`: seconds every byte takes each way, in order (a queue per direction: requests a client
pipelines stay pipelined, as on a real link), so that a round trip takes 2 x delay more: a
server further away than loopback (a Kafka cluster answers acks=all in milliseconds, not in the
fraction of one that a broker on this machine takes). Run as a program for a process of its own:

    python -m tests.kit.tcp_proxy LISTEN_PORT TARGET_PORT ONE_WAY_MS
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from types import TracebackType


class TcpProxy:
    def __init__(self, target: tuple[str, int], *, delay: float = 0.0, port: int = 0) -> None:
        self.target = target
        """Read at each connection: it may be set after the proxy listens."""
        self.delay = delay
        self.port = port
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
        if self.delay > 0:
            self._pump_delayed(source, sink)
            return
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._ended(source, sink)

    def _pump_delayed(self, source: socket.socket, sink: socket.socket) -> None:
        """What `source` sends reaches `sink` `delay` seconds later (a thread delivers it)."""
        due: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        threading.Thread(target=self._deliver, args=(due, source, sink), daemon=True, name="tcp-proxy-deliver").start()
        try:
            while data := source.recv(65536):
                due.put((time.monotonic() + self.delay, data))
        except OSError:
            pass
        finally:
            due.put((0.0, b""))

    def _deliver(self, due: queue.SimpleQueue[tuple[float, bytes]], source: socket.socket, sink: socket.socket) -> None:
        try:
            while (item := due.get())[1]:
                wait = item[0] - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                sink.sendall(item[1])
        except OSError:
            pass
        finally:
            self._ended(source, sink)

    def _ended(self, source: socket.socket, sink: socket.socket) -> None:
        for conn in (source, sink):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._open.discard(source)
        source.close()


if __name__ == "__main__":
    listen_port, target_port, one_way_ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    TcpProxy(("127.0.0.1", target_port), delay=one_way_ms / 1000, port=listen_port)
    threading.Event().wait()  # until killed
