from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import httpx

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
