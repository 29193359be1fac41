"""Connection settings for the Kubernetes API: kubeconfig or in-cluster.

Shared by the operator, the worker SDK and the dev tooling so that they all
speak to the API server the same way (httpx, sync or async).
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeConfig:
    server: str
    ssl_context: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None
    namespace: str = "default"

    def auth(self) -> httpx.Auth | None:
        """Bearer auth applied per request, so a rotated projected token is picked up."""
        if self.token_file is not None:
            return _TokenFileAuth(self.token_file)
        if self.token:
            return _TokenFileAuth(None, self.token)
        return None

    def sync_client(self, timeout: float = 10.0, server: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=server or self.server, verify=self.ssl_context, auth=self.auth(),
                            timeout=timeout)

    def async_client(self, timeout: float = 10.0, limits: httpx.Limits | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server, verify=self.ssl_context, auth=self.auth(), timeout=timeout,
                                 limits=limits or httpx.Limits(max_connections=100, max_keepalive_connections=20))


class _TokenFileAuth(httpx.Auth):
    """Reads the token file again when it changed on disk (the kubelet rotates projected tokens)."""

    def __init__(self, path: Path | None, token: str = "") -> None:
        self.path = path
        self.token = token
        self._mtime = -1.0

    def _current(self) -> str:
        if self.path is not None:
            mtime = self.path.stat().st_mtime
            if mtime != self._mtime:
                self.token, self._mtime = self.path.read_text().strip(), mtime
        return self.token

    def auth_flow(self, request: httpx.Request):  # type: ignore[no-untyped-def]
        request.headers["Authorization"] = f"Bearer {self._current()}"
        yield request


def _read_data(entry: dict[str, Any], key: str, base: Path) -> bytes | None:
    if entry.get(f"{key}-data"):
        return base64.b64decode(entry[f"{key}-data"])
    if entry.get(key):
        path = Path(entry[key])
        return (path if path.is_absolute() else base / path).read_bytes()
    return None


def _load_cert_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl only loads client certificates from files; keep them on disk only
    # for the duration of the call.
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp) / "c.crt", Path(tmp) / "c.key"
        cert_path.write_bytes(cert)
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        ctx.load_cert_chain(str(cert_path), str(key_path))


def from_kubeconfig(path: Path, context: str | None = None) -> KubeConfig:
    doc = yaml.safe_load(path.read_text())
    base = path.parent
    ctx_name = context or doc.get("current-context")
    ctx = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
    user = next((u["user"] for u in doc.get("users", []) if u["name"] == ctx.get("user")), {}) or {}

    ca = _read_data(cluster, "certificate-authority", base)
    ssl_ctx = ssl.create_default_context(cadata=ca.decode() if ca else None)
    if cluster.get("insecure-skip-tls-verify"):
        ssl_ctx.check_hostname = False
        ssl_ctx.verify_mode = ssl.CERT_NONE
    cert = _read_data(user, "client-certificate", base)
    key = _read_data(user, "client-key", base)
    if cert and key:
        _load_cert_chain(ssl_ctx, cert, key)
    token_file = user.get("tokenFile")
    return KubeConfig(
        server=cluster["server"].rstrip("/"),
        ssl_context=ssl_ctx,
        token=user.get("token"),
        token_file=(base / token_file) if token_file else None,
        namespace=ctx.get("namespace", "default"),
    )


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    ssl_ctx = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
    ns_file = sa_dir / "namespace"
    return KubeConfig(
        server=f"https://{host}:{port}",
        ssl_context=ssl_ctx,
        token_file=sa_dir / "token",
        namespace=ns_file.read_text().strip() if ns_file.exists() else "default",
    )


def load(kubeconfig: str | os.PathLike[str] | None = None) -> KubeConfig:
    """Explicit path, then $KUBECONFIG, then in-cluster, then ~/.kube/config."""
    if kubeconfig:
        return from_kubeconfig(Path(kubeconfig))
    if os.environ.get("KUBECONFIG"):
        return from_kubeconfig(Path(os.environ["KUBECONFIG"].split(os.pathsep)[0]))
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT_DIR / "token").exists():
        return in_cluster()
    return from_kubeconfig(Path.home() / ".kube" / "config")
