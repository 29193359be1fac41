"""kubectl-tether's commands, driven through main() against a fake API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether import plugin
from tether.devcluster import demo

pytestmark = pytest.mark.unit


class _FakeConfig:
    """Stands in for a kubeconfig: every client talks to `handler` instead of a server."""

    namespace = "default"

    def __init__(self, handler: Any) -> None:
        self.transport = httpx.MockTransport(handler)

    def async_client(self, **_: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url="https://api.test", transport=self.transport)

    def sync_client(self, **_: Any) -> httpx.Client:
        return httpx.Client(base_url="https://api.test", transport=self.transport)


@pytest.mark.parametrize(("command", "said", "spec"), [
    ("stop", "stopped", {"stop": True}),
    ("suspend", "suspended", {"suspend": True}),
    ("resume", "resumed", {"suspend": False}),
])
def test_control_commands_say_what_they_did(command: str, said: str, spec: dict[str, bool],
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    patches: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        patches.append(json.loads(request.content))
        return httpx.Response(200, json={})

    monkeypatch.setattr(plugin.kubeconfig, "load", lambda _path: _FakeConfig(handler))
    assert plugin.main([command, "job", "-n", "ns"]) == 0
    assert capsys.readouterr().out == f"workerrun.tether.dev/job {said}\n"
    assert patches == [{"spec": spec}]


def test_demo_offers_kubectl_only_while_its_cluster_stays() -> None:
    kubeconfig, bin_dir = Path("/r/.tether/demo/kubeconfig"), Path("/cache/bin")
    kept = "\n".join(demo.ending(kubeconfig, bin_dir, keep=True))
    assert f"export KUBECONFIG={kubeconfig}" in kept and "Ctrl-C" in kept
    gone = "\n".join(demo.ending(kubeconfig, bin_dir, keep=False))
    assert "KUBECONFIG" not in gone and str(kubeconfig.parent) not in gone
    assert "make demo" in gone  # how to get a cluster that stays
