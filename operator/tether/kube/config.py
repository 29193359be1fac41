"""Connection settings for the Kubernetes API: any kubeconfig kubectl accepts, or in-cluster.

Shared by the operator, the worker SDK, the plugin, the console and the dev tooling so that they
all speak to the API server the same way (httpx, sync or async). Kubeconfigs are read by the
`kubernetes` package's loader (merged KUBECONFIG files, contexts, exec credential plugins with
their expiry, auth providers, TLS and proxy settings); httpx stays the transport, fed from what
the loader resolved. What the loader leaves out, kubectl's flags and a kubeconfig user's
impersonation (`as`, `as-groups`, `as-uid`), is applied here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio.to_thread
import httpx
from kubernetes.client import Configuration
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.dateutil import parse_rfc3339
from kubernetes.config.exec_provider import ExecProvider
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
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()  # a kubeconfig user's as-user-extra

    def headers(self) -> list[tuple[str, str]]:
        if self.user is None:
            return []
        return ([("Impersonate-User", self.user)] + [("Impersonate-Group", g) for g in self.groups]
                + ([("Impersonate-Uid", self.uid)] if self.uid else [])
                + [(f"Impersonate-Extra-{quote(key, safe='')}", v) for key, values in self.extra for v in values])


# How long any client, blocking or asyncio, waits for an exec credential plugin (a token refresh,
# with the wait for another request's run of it) before the plugin is killed and the request fails
# as a transport error; kubectl waits for ever, so this is generous (an interactive login may be
# behind it). Read at each run, so a test can shorten it.
EXEC_TIMEOUT = 120.0


class CredentialError(ConfigError, httpx.TransportError):
    """An exec plugin gave no credential: to a command, a configuration error in the plugin's
    words (kubectl's `getting credentials: ...`); to a long-running client, a transport failure
    to retry (a worker's renewal tries again, it does not crash)."""


class ExecPlugin(ExecProvider):
    """The `kubernetes` package's ExecProvider (its reading of the kubeconfig's exec entry) with a
    run that has a bound: its own run() waits for the process for ever. Past the bound the plugin
    is killed, with whatever it started (a script's commands), and the run raises TimeoutExpired."""

    def run(self, timeout: float) -> dict[str, Any]:  # type: ignore[override]
        interactive = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
        spec: dict[str, Any] = {"interactive": interactive}
        if self.cluster:  # provideClusterInfo, with the cluster's exec extension as its config
            config = [e["extension"] for e in self.cluster.value.get("extensions") or []
                      if e["name"] == "client.authentication.k8s.io/exec"]
            spec["cluster"] = {**self.cluster.value, **({"config": config[0]} if config else {})}
        self.env["KUBERNETES_EXEC_INFO"] = json.dumps(
            {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec})
        # A group of its own, so the kill reaches its children too; not a plugin talking to the
        # terminal, which must stay in the terminal's session (its prompt reads /dev/tty).
        group = not interactive and os.name == "posix"
        with subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=sys.stderr if interactive else subprocess.PIPE,
                              stdin=sys.stdin if interactive else None, cwd=self.cwd, env=self.env, text=True,
                              shell=getattr(self, "shell", False),  # older kubernetes packages have none
                              start_new_session=group) as process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                if group:
                    with suppress(ProcessLookupError):  # all of it ended meanwhile
                        os.killpg(process.pid, signal.SIGKILL)
                else:
                    process.kill()
                raise  # leaving the with reaps it, without waiting for its output's end
        if process.returncode != 0:
            said = (stderr or "").strip()
            raise ConfigException(f"exec: process returned {process.returncode}" + (f". {said}" if said else ""))
        try:
            data = json.loads(stdout)
        except ValueError as exc:
            raise ConfigException(f"exec: failed to decode process output: {exc}") from exc
        for key in ("apiVersion", "kind", "status"):
            if key not in data:
                raise ConfigException(f"exec: malformed response. missing key '{key}'")
        if data["apiVersion"] != self.api_version:
            raise ConfigException(f"exec: plugin api version {data['apiVersion']} does not match {self.api_version}")
        return data["status"]


class Credentials:
    """An exec plugin's token (EKS, GKE, AKS, OIDC helpers), run through ExecPlugin: kept until a
    tenth of its lifetime (at most 5 minutes) before the expiry it was given, fetched again at once
    after a 401. A failed run raises CredentialError instead of going on with the old token. A
    lock: one run of the plugin, whatever number of requests found the token stale at the same
    moment. Each request waits EXEC_TIMEOUT at most, for the lock and its own run together: the
    blocking clients and the asyncio ones (from a thread) share this one bound."""

    def __init__(self, provider: ExecPlugin, clock: Callable[[], float] = time.time) -> None:
        self._provider, self._clock = provider, clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._fetched = 0.0
        self._expiry: float | None = None

    def fetch_first(self) -> dict[str, Any]:
        """The plugin's first answer (a token, or a client certificate the caller loads)."""
        with self._turn() as deadline:
            return self._fetch(deadline)

    @contextmanager
    def _turn(self) -> Iterator[float]:
        """Holds the lock, taken within EXEC_TIMEOUT (another request's run of the plugin holds it
        meanwhile); gives the monotonic deadline of this request's own run."""
        bound = EXEC_TIMEOUT
        deadline = time.monotonic() + bound
        if not self._lock.acquire(timeout=bound):
            raise CredentialError(f"getting credentials: the exec plugin did not answer within {bound:g}s "
                                  "(another request's run of it)")
        try:
            yield deadline
        finally:
            self._lock.release()

    def _fetch(self, deadline: float) -> dict[str, Any]:
        try:
            status = dict(self._provider.run(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as exc:
            raise CredentialError(f"getting credentials: the exec plugin did not answer within {EXEC_TIMEOUT:g}s") \
                from exc
        except ConfigException as exc:
            raise CredentialError(f"getting credentials: {exc}") from exc
        self._token, self._fetched = status.get("token") or None, self._clock()
        expiry = status.get("expirationTimestamp")
        self._expiry = parse_rfc3339(expiry).timestamp() if expiry else None
        return status

    def _stale(self) -> bool:
        if self._expiry is None:
            return False
        margin = min(300.0, max(0.0, self._expiry - self._fetched) / 10)
        return self._clock() >= self._expiry - margin

    def header(self, stale: str | None = None) -> str | None:
        """The Authorization value; `stale` is one the API server just refused (401)."""
        with self._turn() as deadline:
            if self._token is None or self._stale() or (stale is not None and stale == f"Bearer {self._token}"):
                self._fetch(deadline)
                if self._token is None:
                    raise CredentialError("getting credentials: the exec plugin's answer has no token")
            return f"Bearer {self._token}"


@dataclass(frozen=True)
class KubeConfig:
    server: str
    ssl_context: ssl.SSLContext
    token: str | None = None  # a bearer token
    token_file: Path | None = None
    namespace: str = "default"
    credentials: Credentials | None = None
    authorization: str | None = None  # any other fixed Authorization value (a user's basic auth)
    impersonation: Impersonation = field(default_factory=Impersonation)
    tls_server_name: str | None = None
    proxy: str | None = None
    request_timeout: float | None = None  # --request-timeout: overrides every client's own timeout

    def auth(self) -> httpx.Auth | None:
        """What each request carries (credentials, impersonation, the TLS server name), applied per
        request so a rotated token file or a refreshed exec credential is picked up."""
        if (self.token_file is None and not self.token and self.credentials is None and not self.authorization
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
        return f"Bearer {self.cfg.token}" if self.cfg.token else self.cfg.authorization

    def _prepare(self, request: httpx.Request, header: str | None) -> None:
        if header is not None:
            request.headers["Authorization"] = header
        extra = self.cfg.impersonation.headers()
        if extra:  # one line per group (or extra value), as client-go sends them
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
        header = await self._refreshed() if refreshable else self._header()
        self._prepare(request, header)
        response = yield request
        if response.status_code == 401 and refreshable:
            self._prepare(request, await self._refreshed(stale=header))
            yield request

    async def _refreshed(self, stale: str | None = None) -> str | None:
        """The header from a thread (within EXEC_TIMEOUT, as Credentials bounds it: httpx's timeout
        does not cover it), abandoned at once when the awaiting task is cancelled: the plugin's run
        goes on in its thread, holding the credentials' lock, until it answers or is killed."""
        return await anyio.to_thread.run_sync(lambda: self._header(stale), abandon_on_cancel=True)


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


def _ssl_context(configuration: Configuration, exec_cert: dict[str, Any] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if exec_cert is not None:  # an exec plugin's client certificate (not refreshed: see docs/install.md)
        _load_cert_chain(ctx, exec_cert["clientCertificateData"].encode(), exec_cert["clientKeyData"].encode())
    elif configuration.cert_file and configuration.key_file:
        ctx.load_cert_chain(configuration.cert_file, configuration.key_file)
    if not configuration.verify_ssl:  # insecure-skip-tls-verify
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _load_cert_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl loads client certificates only from files: on disk for the duration of the call alone.
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp) / "c.crt", Path(tmp) / "c.key"
        cert_path.write_bytes(cert)
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        ctx.load_cert_chain(str(cert_path), str(key_path))


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


# File fields, relative to the file that holds them (the loader takes them relative to the cluster's).
_FILE_FIELDS = {"users": ("client-certificate", "client-key", "tokenFile"), "clusters": ("certificate-authority",)}


def _absolute_paths(merged: ConfigNode) -> None:
    for kind, keys in _FILE_FIELDS.items():
        for node in merged.value.get(kind) or []:
            entry, base = node.value.get(kind[:-1]) or {}, Path(node.path).parent if node.path else Path.cwd()
            for key in keys:
                if entry.get(key) and not Path(os.path.expanduser(entry[key])).is_absolute():
                    entry[key] = str(base / entry[key])
            command = (entry.get("exec") or {}).get("command") if kind == "users" else None
            if command and "/" in command and not command.startswith("/"):  # ./plugin: beside its kubeconfig
                entry["exec"]["command"] = str(base / command)


def _node(merged: ConfigNode, kind: str, name: str | None) -> ConfigNode | None:
    found = [n for n in merged.value.get(kind) or [] if name and n["name"] == name]
    return found[0] if found else None


def from_flags(flags: Flags) -> KubeConfig:
    """A kubeconfig as kubectl reads it with these flags. Whatever is wrong with it, a ConfigError
    that says so (never another exception: the plugin prints it as kubectl would)."""
    try:
        return _from_flags(flags)
    except ConfigError:
        raise
    except Exception as exc:  # a malformed file: YAML, base64, PEM, a missing file it names...
        raise ConfigError(f"invalid kubeconfig {_paths(flags)}: {type(exc).__name__}: {exc}") from exc


def _from_flags(flags: Flags) -> KubeConfig:
    paths = _paths(flags)
    merger = KubeConfigMerger(paths)
    merged = merger.config
    if merged is None:
        raise ConfigError(f"no kubeconfig found at {paths} (give --kubeconfig, or set KUBECONFIG)")
    _absolute_paths(merged)
    context = _context(merger, flags)
    context.update({k: v for k, v in (("cluster", flags.cluster), ("user", flags.user)) if v})
    cluster = _node(merged, "clusters", context.get("cluster"))
    if cluster is None:
        raise ConfigError(f'cluster "{context.get("cluster")}" does not exist in {paths}')
    user_node = _node(merged, "users", context.get("user"))
    if context.get("user") and user_node is None:
        raise ConfigError(f'user "{context.get("user")}" does not exist in {paths}')
    user = dict(user_node.value.get("user") or {}) if user_node is not None else {}
    credentials, exec_cert = None, None
    if "exec" in user:
        # The plugin is run here (not by the loader, which logs a failure and goes on anonymous).
        credentials = Credentials(ExecPlugin(user_node["user"]["exec"],  # type: ignore[index]
                                             str(Path(user_node.path).parent) if user_node.path else None,  # type: ignore[union-attr]
                                             cluster["cluster"]))
        first = credentials.fetch_first()
        if "token" not in first:
            if not (first.get("clientCertificateData") and first.get("clientKeyData")):
                raise ConfigError("getting credentials: the exec plugin gave neither a token nor a client certificate")
            credentials, exec_cert = None, first
        del user_node.value["user"]["exec"]  # type: ignore[union-attr]
    server = (cluster.value.get("cluster") or {}).get("server")
    if not server:
        raise ConfigError(f'no server found for cluster "{context.get("cluster")}"')
    if "://" not in server:
        cluster.value["cluster"]["server"] = f"https://{server}"  # as kubectl reads host:port
    merged.value["contexts"].append(ConfigNode("flags", {"name": FLAGS_CONTEXT, "context": context}))
    configuration = Configuration()
    try:
        KubeConfigLoader(config_dict=merged, active_context=FLAGS_CONTEXT, config_base_path=None) \
            .load_and_set(configuration)
    except ConfigException as exc:
        raise ConfigError(str(exc)) from exc
    header = configuration.api_key.get("BearerToken")
    token = str(header).removeprefix("Bearer ") if header and str(header).startswith("Bearer ") else None
    token_file = user.get("tokenFile")
    impersonation = Impersonation(flags.impersonate or user.get("as"),
                                  tuple(flags.impersonate_groups or user.get("as-groups") or ()),
                                  flags.impersonate_uid or user.get("as-uid"),
                                  tuple((k, tuple(v)) for k, v in (user.get("as-user-extra") or {}).items()))
    if impersonation.user is None and (impersonation.groups or impersonation.uid or impersonation.extra):
        raise ConfigError("requesting uid, groups or user-extra without impersonating a user (give --as)")
    return KubeConfig(
        server=configuration.host,
        ssl_context=_ssl_context(configuration, exec_cert),
        # A tokenFile is read again when it changes (the loader reads it once).
        token=None if token_file or credentials else token,
        token_file=Path(token_file) if token_file else None,
        namespace=flags.namespace or context.get("namespace") or "default",
        credentials=credentials,
        authorization=str(header) if header and token is None else None,
        impersonation=impersonation,
        tls_server_name=configuration.tls_server_name,
        proxy=configuration.proxy,
        request_timeout=flags.request_timeout,
    )


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
    in_a_pod = os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT_DIR / "token").exists()
    if in_a_pod and not (flags.context or flags.cluster or flags.user):  # those name a kubeconfig's entries
        if (flags.impersonate_groups or flags.impersonate_uid) and not flags.impersonate:
            raise ConfigError("requesting uid or groups without impersonating a user (give --as)")
        cfg = in_cluster(SERVICE_ACCOUNT_DIR)
        return dataclasses.replace(cfg, namespace=flags.namespace or cfg.namespace, request_timeout=flags.request_timeout,
                                   impersonation=Impersonation(flags.impersonate, flags.impersonate_groups,
                                                               flags.impersonate_uid))
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
