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


def test_an_expiring_exec_credential_is_fetched_again(tmp_path: Path) -> None:
    # The loader refreshes 5 minutes before the expiry it is told: this one is stale at once.
    user, count = _plugin(tmp_path, ["first", "second", "third"], expires_in=60)
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

    async def main() -> int:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), auth=cfg.auth()) as c:
            return (await c.get("https://h/api")).status_code

    assert asyncio.run(main()) == 200
    assert sent == ["Bearer revoked", "Bearer fresh"]


def test_a_failing_plugin_is_an_error_not_anonymous(tmp_path: Path) -> None:
    user, _ = _plugin(tmp_path, ["x"], fail=True)
    with pytest.raises(config.ConfigError, match="getting credentials: exec plugin"):
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
        assert "http://proxy:3128" in repr(c._transport_for_url(httpx.URL(cfg.server)).__dict__) or \
            c._transport_for_url(httpx.URL(cfg.server)) is not c._transport
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
