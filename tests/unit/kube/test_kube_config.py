from __future__ import annotations

import base64
import ssl
import sys
import os
import time
from pathlib import Path

import httpx
import pytest

import yaml

from tether.devcluster import pki
from tether.devcluster.kubelet import _field_ref
from tether.kube import config


def test_kubeconfig_with_embedded_client_cert(tmp_path: Path) -> None:
    ca = pki.CertificateAuthority(tmp_path)
    admin = ca.issue("admin", "me", ("system:masters",))
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443/",
                                               "certificate-authority-data": b64(ca.pair.cert_pem())}}],
        "users": [{"name": "u", "user": {"client-certificate-data": b64(admin.cert_pem()),
                                         "client-key-data": b64(admin.key_pem())}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "agents"}}],
        "current-context": "x",
    }))
    cfg = config.load(path)
    assert cfg.server == "https://127.0.0.1:6443"
    assert cfg.namespace == "agents"
    assert cfg.auth() is None  # the client certificate authenticates


def test_kubeconfig_token_file_is_reread(tmp_path: Path) -> None:
    ca = pki.CertificateAuthority(tmp_path)
    token = tmp_path / "token"
    token.write_text("one\n")
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "clusters": [{"name": "c", "cluster": {"server": "https://h:1", "certificate-authority": str(ca.pair.cert)}}],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }))
    cfg = config.load(path)
    # A long-lived client sees the rotated token on its next request, without being rebuilt.
    auth = cfg.auth()
    assert auth is not None
    request = httpx.Request("GET", "https://h:1/api")
    assert next(auth.auth_flow(request)).headers["Authorization"] == "Bearer one"
    token.write_text("two")
    os.utime(token, (time.time() + 2, time.time() + 2))
    assert next(auth.auth_flow(httpx.Request("GET", "https://h:1/api"))).headers["Authorization"] == "Bearer two"
    token.write_text("three")
    os.utime(token, (time.time() + 5, time.time() + 5))
    assert next(auth.auth_flow(httpx.Request("GET", "https://h:1/api"))).headers["Authorization"] == "Bearer three"


def test_downward_api_field_refs() -> None:
    pod = {"metadata": {"name": "p", "namespace": "n", "uid": "u1", "labels": {"a": "b"},
                        "annotations": {"tether.dev/fence": "4"}},
           "spec": {"nodeName": "node", "serviceAccountName": "sa"}}
    assert _field_ref(pod, "metadata.name") == "p"
    assert _field_ref(pod, "spec.serviceAccountName") == "sa"
    assert _field_ref(pod, "metadata.labels['a']") == "b"
    assert _field_ref(pod, "metadata.annotations['tether.dev/fence']") == "4"
    assert _field_ref(pod, "metadata.labels['missing']") == ""


# --- any kubeconfig kubectl accepts (the `kubernetes` package's loader, kubectl's flags) ---------

def _cluster(ca: pki.CertificateAuthority, server: str = "https://127.0.0.1:6443", **extra: object) -> dict[str, object]:
    return {"server": server, "certificate-authority-data": base64.b64encode(ca.pair.cert_pem()).decode(), **extra}


def _plugin(tmp_path: Path, tokens: list[str], expires_in: float | None = None, fail: bool = False) -> tuple[dict[str, object], Path]:
    """An exec credential plugin printing the next of `tokens` at each run (the count in a file)."""
    count = tmp_path / "plugin-runs"
    script = tmp_path / "plugin.py"
    script.write_text(f"""
import datetime, json, pathlib, sys
count = pathlib.Path({str(count)!r})
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
if {fail!r}:
    print("no credentials for you", file=sys.stderr)
    sys.exit(3)
status = {{"token": {tokens!r}[min(n, {len(tokens) - 1})]}}
if {expires_in!r} is not None:
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds={expires_in!r} or 0)
    status["expirationTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}}))
""")
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                     "args": [str(script)], "interactiveMode": "Never"}}, count


def _write(path: Path, doc: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def _ca(folder: Path) -> pki.CertificateAuthority:
    folder.mkdir(parents=True, exist_ok=True)
    return pki.CertificateAuthority(folder)


def _one(tmp_path: Path, user: dict[str, object], **cluster: object) -> Path:
    ca = _ca(tmp_path / "ca")
    return _write(tmp_path / "kubeconfig", {
        "clusters": [{"name": "c", "cluster": _cluster(ca, **cluster)}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}], "current-context": "x"})


def _authorization(auth: httpx.Auth | None, answers: list[int] | None = None) -> list[str]:
    """The Authorization headers a client with `auth` sends for one GET, answered with `answers`."""
    sent: list[str] = []
    statuses = iter(answers or [200])

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("Authorization", ""))
        return httpx.Response(next(statuses))

    with httpx.Client(transport=httpx.MockTransport(handler), auth=auth) as c:
        c.get("https://h/api")
    return sent


def test_an_exec_plugin_gives_the_token(tmp_path: Path) -> None:
    user, count = _plugin(tmp_path, ["from-the-plugin"])
    cfg = config.load(_one(tmp_path, user))
    assert _authorization(cfg.auth()) == ["Bearer from-the-plugin"]
    assert _authorization(cfg.auth()) == ["Bearer from-the-plugin"]
    assert count.read_text() == "1"  # not expiring: one run of the plugin serves every request


def test_a_credential_is_kept_for_its_lifetime(tmp_path: Path) -> None:
    # Two minutes: kept until 12 s before its expiry (a tenth of its lifetime), not run per request.
    user, count = _plugin(tmp_path, ["first", "second"], expires_in=120)
    cfg = config.load(_one(tmp_path, user))
    assert [h for _ in range(5) for h in _authorization(cfg.auth())] == ["Bearer first"] * 5
    assert count.read_text() == "1"


def test_an_expired_exec_credential_is_fetched_again(tmp_path: Path) -> None:
    user, count = _plugin(tmp_path, ["first", "second", "third"], expires_in=-10)
    cfg = config.load(_one(tmp_path, user))
    assert _authorization(cfg.auth()) == ["Bearer second"]
    assert _authorization(cfg.auth()) == ["Bearer third"]
    assert count.read_text() == "3"


def test_a_401_runs_the_plugin_again_and_resends_once(tmp_path: Path) -> None:
    user, count = _plugin(tmp_path, ["revoked", "fresh"], expires_in=3600)
    cfg = config.load(_one(tmp_path, user))
    assert _authorization(cfg.auth(), [401, 200]) == ["Bearer revoked", "Bearer fresh"]
    # Refused again: no third try (a wrong credential is not retried forever).
    assert _authorization(cfg.auth(), [401, 401]) == ["Bearer fresh", "Bearer fresh"]


def test_the_async_client_refreshes_off_the_event_loop(tmp_path: Path) -> None:
    import asyncio

    user, count = _plugin(tmp_path, ["revoked", "fresh"], expires_in=3600)
    cfg = config.load(_one(tmp_path, user))
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers["Authorization"])
        return httpx.Response(401 if request.headers["Authorization"] == "Bearer revoked" else 200)

    import threading

    ran_on: list[str] = []
    fetch = cfg.credentials._fetch  # type: ignore[union-attr]

    def recording(deadline: float) -> dict[str, object]:
        ran_on.append(threading.current_thread().name)
        return fetch(deadline)

    cfg.credentials._fetch = recording  # type: ignore[union-attr,method-assign]

    async def main() -> int:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), auth=cfg.auth()) as c:
            return (await c.get("https://h/api")).status_code

    assert asyncio.run(main()) == 200
    assert sent == ["Bearer revoked", "Bearer fresh"]
    assert ran_on and threading.main_thread().name not in ran_on, ran_on  # never on the event loop's thread


def test_a_failing_plugin_is_an_error_not_anonymous(tmp_path: Path) -> None:
    user, _ = _plugin(tmp_path, ["x"], fail=True)
    with pytest.raises(config.ConfigError, match="getting credentials: exec: process returned 3. no credentials for you"):
        config.load(_one(tmp_path, user))


def test_several_kubeconfig_files_merge_as_kubectl_merges_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = _ca(tmp_path / "ca")
    first = _write(tmp_path / "first", {
        "users": [{"name": "u", "user": {"token": "mine"}}],
        "contexts": [{"name": "work", "context": {"cluster": "c", "user": "u", "namespace": "agents"}}],
        "current-context": "work"})
    second = _write(tmp_path / "second", {
        "clusters": [{"name": "c", "cluster": _cluster(ca, "https://10.0.0.1:6443")}],
        "users": [{"name": "u", "user": {"token": "not-mine"}}],  # the first file's u wins
        "contexts": [{"name": "other", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "other"})  # so does its current-context
    monkeypatch.setenv("KUBECONFIG", f"{first}{os.pathsep}{tmp_path / 'missing'}{os.pathsep}{second}")
    cfg = config.load()
    assert (cfg.server, cfg.namespace, cfg.token) == ("https://10.0.0.1:6443", "agents", "mine")
    assert config.load(flags=config.Flags(context="other")).namespace == "default"


def test_kubectl_flags_pick_context_cluster_user_namespace(tmp_path: Path) -> None:
    ca = _ca(tmp_path / "ca")
    path = _write(tmp_path / "kubeconfig", {
        "clusters": [{"name": "a", "cluster": _cluster(ca, "https://a:6443")},
                     {"name": "b", "cluster": _cluster(ca, "https://b:6443")}],
        "users": [{"name": "ann", "user": {"token": "ann"}}, {"name": "bob", "user": {"token": "bob"}}],
        "contexts": [{"name": "ann@a", "context": {"cluster": "a", "user": "ann", "namespace": "ns-a"}},
                     {"name": "bob@b", "context": {"cluster": "b", "user": "bob"}}],
        "current-context": "ann@a"})
    pick = lambda **kw: config.load(flags=config.Flags(kubeconfig=str(path), **kw))  # noqa: E731
    assert (pick().server, pick().token, pick().namespace) == ("https://a:6443", "ann", "ns-a")
    assert (pick(context="bob@b").server, pick(context="bob@b").token) == ("https://b:6443", "bob")
    assert (pick(cluster="b").server, pick(cluster="b").token, pick(cluster="b").namespace) == ("https://b:6443", "ann", "ns-a")
    assert pick(user="bob", namespace="mine").token == "bob" and pick(namespace="mine").namespace == "mine"
    for flags, message in ((dict(context="nope"), 'context "nope" does not exist'),
                           (dict(cluster="nope"), 'cluster "nope" does not exist'),
                           (dict(user="nope"), 'user "nope" does not exist'),
                           (dict(impersonate_groups=("g",)), "without impersonating a user")):
        with pytest.raises(config.ConfigError, match=message):
            pick(**flags)


def test_impersonation_from_flags_or_the_kubeconfig_user(tmp_path: Path) -> None:
    path = _one(tmp_path, {"token": "t", "as": "carol", "as-groups": ["team-a"]})
    sent: list[list[tuple[str, str]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append([(k, v) for k, v in request.headers.multi_items() if k.lower().startswith("impersonate")])
        return httpx.Response(200)

    for flags in (config.Flags(kubeconfig=str(path)),
                  config.Flags(kubeconfig=str(path), impersonate="dave", impersonate_groups=("g1", "g2"), impersonate_uid="42")):
        with httpx.Client(transport=httpx.MockTransport(handler), auth=config.load(flags=flags).auth()) as c:
            c.get("https://h/api")
    assert sent == [[("impersonate-user", "carol"), ("impersonate-group", "team-a")],
                    [("impersonate-user", "dave"), ("impersonate-group", "g1"), ("impersonate-group", "g2"),
                     ("impersonate-uid", "42")]]


def test_tls_server_name_insecure_and_proxy_are_honoured(tmp_path: Path) -> None:
    cfg = config.load(_one(tmp_path, {"token": "t"}, **{"tls-server-name": "api.internal", "proxy-url": "http://proxy:3128"}))
    assert (cfg.tls_server_name, cfg.proxy) == ("api.internal", "http://proxy:3128")
    seen: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions.get("sni_hostname"))
        return httpx.Response(200)

    with httpx.Client(transport=httpx.MockTransport(handler), auth=cfg.auth()) as c:
        c.get("https://10.0.0.1/api")
    assert seen == ["api.internal"]
    with cfg.sync_client() as c:  # requests to the API server go through the proxy
        transport = c._transport_for_url(httpx.URL(cfg.server))
        assert transport is not c._transport and transport._pool._proxy_url.host == b"proxy"  # type: ignore[attr-defined]
    (tmp_path / "i").mkdir()
    insecure = config.load(_one(tmp_path / "i", {"token": "t"}, **{"insecure-skip-tls-verify": True}))
    assert insecure.ssl_context.verify_mode == ssl.CERT_NONE and not insecure.ssl_context.check_hostname


@pytest.mark.parametrize(("given", "seconds"), [("30", 30.0), ("0", 0.0), ("30s", 30.0), ("2m", 120.0),
                                                  ("1m30s", 90.0), ("1h", 3600.0), ("500ms", 0.5)])
def test_request_timeout_reads_like_kubectls(given: str, seconds: float) -> None:
    assert config.parse_timeout(given) == seconds


@pytest.mark.parametrize("given", ["", "abc", "5x", "-1", "1m-2s"])
def test_a_bad_request_timeout_says_what_to_give(given: str) -> None:
    with pytest.raises(config.ConfigError, match="give seconds"):
        config.parse_timeout(given)


@pytest.mark.parametrize(("text", "said"), [
    ("clusters: [", "ParserError"), ("just a string", "TypeError"),
    ("clusters: [{name: c, cluster: {server: 'https://h', certificate-authority-data: '!!'}}]\n"
     "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x", "Error"),
    ("clusters: [{name: c, cluster: {server: 'https://h', certificate-authority-data: 'aGVsbG8='}}]\n"
     "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x", "SSLError"),
    ("clusters: [{name: c, cluster: {}}]\nusers: []\ncontexts: [{name: x, context: {cluster: c}}]\ncurrent-context: x",
     'no server found for cluster "c"'),
])
def test_a_malformed_kubeconfig_is_a_config_error_never_another_exception(text: str, said: str, tmp_path: Path) -> None:
    (tmp_path / "kubeconfig").write_text(text)
    with pytest.raises(config.ConfigError, match=said):
        config.load(tmp_path / "kubeconfig")


def test_file_fields_are_relative_to_their_own_file_in_a_merged_kubeconfig(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ca = _ca(tmp_path / "ca")
    admin = ca.issue("admin", "me", ("system:masters",))
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "u.crt").write_bytes(admin.cert_pem())
    (tmp_path / "users" / "u.key").write_bytes(admin.key_pem())
    (tmp_path / "users" / "token").write_text("from-the-users-folder")
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "ca.crt").write_bytes(ca.pair.cert_pem())
    users = _write(tmp_path / "users" / "config", {
        "users": [{"name": "cert", "user": {"client-certificate": "u.crt", "client-key": "u.key"}},
                  {"name": "file", "user": {"tokenFile": "token"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "cert"}}], "current-context": "x"})
    clusters = _write(tmp_path / "clusters" / "config", {
        "clusters": [{"name": "c", "cluster": {"server": "10.0.0.1:6443", "certificate-authority": "ca.crt"}}]})
    monkeypatch.setenv("KUBECONFIG", f"{clusters}{os.pathsep}{users}")
    cfg = config.load()
    assert cfg.server == "https://10.0.0.1:6443"  # host:port, read as kubectl reads it
    assert cfg.ssl_context.get_ca_certs() and cfg.auth() is None  # the CA and the client certificate loaded
    assert _authorization(config.load(flags=config.Flags(user="file")).auth()) == ["Bearer from-the-users-folder"]


def test_basic_auth_and_user_extra_impersonation(tmp_path: Path) -> None:
    path = _one(tmp_path, {"username": "alice", "password": "s3cret", "as": "carol",
                           "as-user-extra": {"reason/why": ["audit"]}})
    seen: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({k: v for k, v in request.headers.items() if k in ("authorization", "impersonate-extra-reason%2fwhy")})
        return httpx.Response(200)

    with httpx.Client(transport=httpx.MockTransport(handler), auth=config.load(path).auth()) as c:
        c.get("https://h/api")
    assert seen == [{"authorization": "Basic " + base64.b64encode(b"alice:s3cret").decode(),
                     "impersonate-extra-reason%2fwhy": "audit"}]


def test_a_plugin_that_fails_later_raises_instead_of_sending_the_old_token(tmp_path: Path) -> None:
    user, count = _plugin(tmp_path, ["only"], expires_in=-10)
    cfg = config.load(_one(tmp_path, user))
    (tmp_path / "plugin.py").write_text("import sys; print('sso session expired', file=sys.stderr); sys.exit(1)")
    with pytest.raises(httpx.TransportError, match="sso session expired"):  # a worker retries it as a transport failure
        _authorization(cfg.auth())


def test_in_a_pod_the_flags_that_apply_still_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("pod-token")
    (sa / "ca.crt").write_bytes(_ca(tmp_path / "ca").pair.cert_pem())
    (sa / "namespace").write_text("pods-ns")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setattr(config, "SERVICE_ACCOUNT_DIR", sa)
    cfg = config.load(flags=config.Flags(impersonate="bob", impersonate_groups=("g",), namespace="mine",
                                         request_timeout=3))
    assert (cfg.impersonation.user, cfg.impersonation.groups, cfg.namespace, cfg.request_timeout) == ("bob", ("g",), "mine", 3)
    with pytest.raises(config.ConfigError, match="no kubeconfig found"):  # a context names a kubeconfig's entry
        config.load(flags=config.Flags(context="other", kubeconfig=str(tmp_path / "none")))
