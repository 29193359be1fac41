"""Connection settings for the Kubernetes API: any kubeconfig kubectl accepts, or in-cluster.

Shared by the operator, the worker SDK, the plugin, the console and the dev tooling so that they
all speak to the API server the same way (httpx, sync or async). Kubeconfigs are read by the
`kubernetes` package's loader (merged KUBECONFIG files, contexts, exec credential plugins with
their expiry, auth providers, TLS and proxy settings); httpx stays the transport, fed from what
the loader resolved. What the loader leaves out, kubectl's flags and a kubeconfig user's
impersonation (`as`, `as-groups`, `as-uid`), is applied here.
"""

from __future__ import annotations

import os
import re
import ssl
import threading
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
from kubernetes.client import Configuration
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.kube_config import ConfigNode, KubeConfigLoader, KubeConfigMerger

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The context the flags make (kubectl's overrides): the chosen one with --cluster/--user/-n applied.
FLAGS_CONTEXT = "tether-flags"


class ConfigError(Exception):
    """The kubeconfig cannot be used as asked; the message reads like kubectl's."""


@dataclass(frozen=True)
class Flags:
    """kubectl's connection flags, with kubectl's meaning; None/empty leaves the kubeconfig's."""

    kubeconfig: str | None = None
    context: str | None = None
    cluster: str | None = None
    user: str | None = None
    namespace: str | None = None
    impersonate: str | None = None  # --as
    impersonate_groups: tuple[str, ...] = ()  # --as-group
    impersonate_uid: str | None = None  # --as-uid
    request_timeout: float | None = None  # seconds; 0 means none (kubectl's default)


@dataclass(frozen=True)
class Impersonation:
    user: str | None = None
    groups: tuple[str, ...] = ()
    uid: str | None = None

    def headers(self) -> list[tuple[str, str]]:
        if self.user is None:
            return []
        return ([("Impersonate-User", self.user)] + [("Impersonate-Group", g) for g in self.groups]
                + ([("Impersonate-Uid", self.uid)] if self.uid else []))


class Credentials:
    """Credentials the loader can refresh (an exec plugin, an auth provider): fetched again when the
    plugin's expirationTimestamp is near, or at once after a 401. A lock: a refresh runs the plugin
    once, whatever number of requests found the token stale at the same moment."""

    def __init__(self, loader: KubeConfigLoader, configuration: Configuration) -> None:
        self._loader, self._configuration = loader, configuration
        self._lock = threading.Lock()

    def header(self, stale: str | None = None) -> str | None:
        """The Authorization value; `stale` is one the API server just refused (401)."""
        with self._lock:
            current = self._configuration.api_key.get("BearerToken")
            if stale is not None and current == stale:
                self._loader.load_and_set(self._configuration)  # kubectl runs the plugin again on a 401
            elif self._configuration.refresh_api_key_hook is not None:
                self._configuration.refresh_api_key_hook(self._configuration)  # only when near its expiry
            value = self._configuration.api_key.get("BearerToken")
            return str(value) if value else None


@dataclass(frozen=True)
class KubeConfig:
    server: str
    ssl_context: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None
    namespace: str = "default"
    credentials: Credentials | None = None
    impersonation: Impersonation = field(default_factory=Impersonation)
    tls_server_name: str | None = None
    proxy: str | None = None
    request_timeout: float | None = None  # --request-timeout: overrides every client's own timeout

    def auth(self) -> httpx.Auth | None:
        """What each request carries (credentials, impersonation, the TLS server name), applied per
        request so a rotated token file or a refreshed exec credential is picked up."""
        if (self.token_file is None and not self.token and self.credentials is None
                and self.impersonation.user is None and self.tls_server_name is None):
            return None
        return _RequestAuth(self)

    def _timeout(self, timeout: float) -> float | None:
        if self.request_timeout is None:
            return timeout
        return self.request_timeout or None

    def sync_client(self, timeout: float = 10.0, server: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=server or self.server, verify=self.ssl_context, auth=self.auth(),
                            timeout=self._timeout(timeout), proxy=self.proxy)

    def async_client(self, timeout: float = 10.0, limits: httpx.Limits | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server, verify=self.ssl_context, auth=self.auth(),
                                 timeout=self._timeout(timeout), proxy=self.proxy,
                                 limits=limits or httpx.Limits(max_connections=100, max_keepalive_connections=20))


class _RequestAuth(httpx.Auth):
    def __init__(self, cfg: KubeConfig) -> None:
        self.cfg = cfg
        self._file_token = _TokenFile(cfg.token_file) if cfg.token_file is not None else None

    def _header(self, stale: str | None = None) -> str | None:
        if self._file_token is not None:
            return f"Bearer {self._file_token.current()}"
        if self.cfg.credentials is not None:
            return self.cfg.credentials.header(stale)
        return f"Bearer {self.cfg.token}" if self.cfg.token else None

    def _prepare(self, request: httpx.Request, header: str | None) -> None:
        if header is not None:
            request.headers["Authorization"] = header
        extra = self.cfg.impersonation.headers()
        if extra:  # one Impersonate-Group line per group, as client-go sends them
            names = {name.lower() for name, _ in extra}
            kept = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in names]
            request.headers = httpx.Headers(kept + extra)
        if self.cfg.tls_server_name:
            request.extensions = {**request.extensions, "sni_hostname": self.cfg.tls_server_name}

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        header = self._header()
        self._prepare(request, header)
        response = yield request
        if response.status_code == 401 and self.cfg.credentials is not None:
            self._prepare(request, self._header(stale=header))
            yield request

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        # A refresh runs the credential plugin (a process): off the event loop.
        refreshable = self.cfg.credentials is not None
        header = await anyio.to_thread.run_sync(self._header) if refreshable else self._header()
        self._prepare(request, header)
        response = yield request
        if response.status_code == 401 and refreshable:
            self._prepare(request, await anyio.to_thread.run_sync(lambda: self._header(stale=header)))
            yield request


class _TokenFile:
    """Reads the token file again when it changed on disk (the kubelet rotates projected tokens)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.token = ""
        self._mtime = -1.0

    def current(self) -> str:
        mtime = self.path.stat().st_mtime
        if mtime != self._mtime:
            self.token, self._mtime = self.path.read_text().strip(), mtime
        return self.token


def _ssl_context(configuration: Configuration) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if configuration.cert_file and configuration.key_file:
        ctx.load_cert_chain(configuration.cert_file, configuration.key_file)
    if not configuration.verify_ssl:  # insecure-skip-tls-verify
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _paths(flags: Flags) -> str:
    """--kubeconfig, else $KUBECONFIG (several files, merged as kubectl merges them), else ~/.kube/config."""
    return flags.kubeconfig or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")


def _current_context(merger: KubeConfigMerger) -> str | None:
    """The first file's that sets one, as kubectl takes it (the loader takes the last file's)."""
    return next((doc["current-context"] for doc in merger.config_files.values() if doc.get("current-context")), None)


def _context(merger: KubeConfigMerger, flags: Flags) -> dict[str, Any]:
    merged = merger.config
    name = flags.context or _current_context(merger)
    if not name:
        if not (flags.cluster and flags.user):
            raise ConfigError("current-context is not set (give --context)")
        return {}
    found = [c for c in merged.value.get("contexts") or [] if c["name"] == name]
    if not found:
        raise ConfigError(f'context "{name}" does not exist')
    return dict(found[0].value.get("context") or {})


def from_flags(flags: Flags) -> KubeConfig:
    """A kubeconfig as kubectl reads it with these flags."""
    paths = _paths(flags)
    try:
        merger = KubeConfigMerger(paths)
    except (OSError, ValueError, ConfigException) as exc:
        raise ConfigError(f"reading kubeconfig {paths}: {exc}") from exc
    merged = merger.config
    if merged is None:
        raise ConfigError(f"no kubeconfig found at {paths} (give --kubeconfig, or set KUBECONFIG)")
    context = _context(merger, flags)
    context.update({k: v for k, v in (("cluster", flags.cluster), ("user", flags.user)) if v})
    for kind, key in (("clusters", "cluster"), ("users", "user")):
        if key == "cluster" or context.get(key):
            if not any(item["name"] == context.get(key) for item in merged.value.get(kind) or []):
                raise ConfigError(f'{key} "{context.get(key)}" does not exist in {paths}')
    merged.value["contexts"].append(ConfigNode("flags", {"name": FLAGS_CONTEXT, "context": context}))
    configuration = Configuration()
    try:
        loader = KubeConfigLoader(config_dict=merged, active_context=FLAGS_CONTEXT, config_base_path=None)
        loader.load_and_set(configuration)
    except ConfigException as exc:
        raise ConfigError(str(exc)) from exc
    user = _user(merged, context.get("user"))
    token = configuration.api_key.get("BearerToken")
    if "exec" in user and not token and not configuration.cert_file:
        # The loader logs the plugin's failure and goes on anonymous; kubectl stops, and so do we.
        raise ConfigError(f"getting credentials: exec plugin {user['exec'].get('command')!r} gave none "
                          "(its error is above)")
    refreshable = token is not None and configuration.refresh_api_key_hook is not None and \
        ("exec" in user or "auth-provider" in user)
    token_file = user.get("tokenFile")
    impersonation = Impersonation(flags.impersonate or user.get("as"),
                                  tuple(flags.impersonate_groups or user.get("as-groups") or ()),
                                  flags.impersonate_uid or user.get("as-uid"))
    if impersonation.user is None and (impersonation.groups or impersonation.uid):
        raise ConfigError("requesting uid or groups without impersonating a user (give --as)")
    return KubeConfig(
        server=configuration.host,
        ssl_context=_ssl_context(configuration),
        # A tokenFile is read again when it changes (the loader reads it once).
        token=None if token_file or refreshable or not token else str(token).removeprefix("Bearer "),
        token_file=_relative(token_file, merged, context.get("user")) if token_file else None,
        namespace=flags.namespace or context.get("namespace") or "default",
        credentials=Credentials(loader, configuration) if refreshable else None,
        impersonation=impersonation,
        tls_server_name=configuration.tls_server_name,
        proxy=configuration.proxy,
        request_timeout=flags.request_timeout,
    )


def _user(merged: ConfigNode, name: str | None) -> dict[str, Any]:
    found = [u for u in merged.value.get("users") or [] if name and u["name"] == name]
    return dict(found[0].value.get("user") or {}) if found else {}


def _relative(path: str, merged: ConfigNode, user: str | None) -> Path:
    """A path in a kubeconfig is relative to the file that holds it (as kubectl resolves it)."""
    found = [u for u in merged.value.get("users") or [] if u["name"] == user]
    base = Path(found[0].path).parent if found and found[0].path else Path.cwd()
    return base / path


def from_kubeconfig(path: Path, context: str | None = None) -> KubeConfig:
    return from_flags(Flags(kubeconfig=str(path), context=context))


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


def load(kubeconfig: str | os.PathLike[str] | None = None, flags: Flags | None = None) -> KubeConfig:
    """Explicit path or --kubeconfig, then $KUBECONFIG, then in-cluster, then ~/.kube/config."""
    flags = flags or Flags()
    if kubeconfig:
        flags = Flags(**{**flags.__dict__, "kubeconfig": os.fspath(kubeconfig)})
    if flags.kubeconfig or os.environ.get("KUBECONFIG"):
        return from_flags(flags)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT_DIR / "token").exists():
        return in_cluster()
    return from_flags(flags)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_timeout(value: str) -> float:
    """kubectl's --request-timeout: seconds as a bare number, or a duration (1s, 2m, 3h, 1m30s); 0 is none."""
    if re.fullmatch(r"\d+", value):
        return float(value)
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ConfigError(f"invalid request timeout {value!r}: give seconds (30) or a duration (30s, 2m)")
    return sum(float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)
