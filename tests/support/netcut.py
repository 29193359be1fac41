"""A TCP proxy that can cut chosen processes off the network.

Connections are attributed to the client process at accept time (psutil).
While a process is cut, the proxy stops moving its bytes in both directions,
like a network partition: the kernel keeps what was sent, and it is delivered
when the cut heals (a late request arrives late).
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

import psutil


class CutProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(128)
        self.port = self._server.getsockname()[1]
        self._cut: set[int] = set()
        self._all_cut = False
        self._healed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self, pid: int) -> None:
        with self._healed:
            self._cut.add(pid)

    def heal(self, pid: int) -> None:
        with self._healed:
            self._cut.discard(pid)
            self._healed.notify_all()

    def cut_all(self) -> None:
        """Cut every connection through this proxy (a worker whose whole network is down)."""
        with self._healed:
            self._all_cut = True

    def heal_all(self) -> None:
        with self._healed:
            self._all_cut = False
            self._healed.notify_all()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._healed:
            self._cut.clear()
            self._all_cut = False
            self._healed.notify_all()

    def _owner(self, client_port: int) -> int | None:
        for conn in psutil.net_connections(kind="tcp4"):
            if conn.laddr and conn.laddr.port == client_port and conn.raddr and conn.raddr.port == self.port:
                return conn.pid
        return None

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, addr = self._server.accept()
            except OSError:
                return
            pid = self._owner(addr[1])
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            blocked: Callable[[], bool] = lambda: self._all_cut or pid in self._cut  # noqa: E731
            threading.Thread(target=self._pump, args=(client, upstream, blocked), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, blocked), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, blocked: Callable[[], bool]) -> None:
        try:
            while True:
                with self._healed:
                    while blocked() and not self._closed:
                        self._healed.wait()
                data = src.recv(65536)
                if not data:
                    break
                with self._healed:
                    while blocked() and not self._closed:
                        self._healed.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
