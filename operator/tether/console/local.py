"""`kubectl tether ui`: the console on 127.0.0.1, with the user's kubeconfig."""

from __future__ import annotations

import contextlib
import socket
import sys
import tempfile
import webbrowser
from html import escape
from pathlib import Path

import uvicorn

from tether.console import security
from tether.console.app import build_local_app
from tether.kube.config import KubeConfig


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))  # never another interface: the session token is the only lock
    sock.listen(128)
    return sock


def _open(url: str, folder: Path) -> None:
    """Opens the URL through a page only this user can read: a browser started with the URL as an
    argument would show the session token to every local user (ps)."""
    page = folder / "open.html"
    page.touch(mode=0o600)
    page.write_text(f'<!doctype html><meta http-equiv="refresh" content="0;url={escape(url)}">'
                    f'<a href="{escape(url)}">Tether console</a>')
    webbrowser.open(page.as_uri())


def serve(cfg: KubeConfig, namespace: str | None, port: int, open_browser: bool = True) -> int:
    try:
        sock = _listen(port)
    except OSError as exc:
        print(f"error: cannot listen on 127.0.0.1:{port}: {exc}", file=sys.stderr)
        return 1
    host, secret = security.local_host(sock.getsockname()[1]), security.new_secret()
    url = f"http://{host}/?token={secret}"
    app = build_local_app(cfg, namespace, host, secret)
    print(f"Tether console ({f'namespace {namespace}' if namespace else 'all namespaces'}, as your kubeconfig's "
          f"user) at\n  {url}\nCtrl-C stops it.", flush=True)
    # Open event streams would otherwise hold the shutdown until every browser tab is closed.
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    with tempfile.TemporaryDirectory(prefix="tether-ui-") as folder:
        if open_browser:
            _open(url, Path(folder))
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(config).run(sockets=[sock])
    return 0
