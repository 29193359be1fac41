"""kubectl-tether's commands, driven through main() against a fake API server."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether import orphans, plugin
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


def test_a_leader_lease_is_a_sign_of_life_only_while_held_and_fresh() -> None:
    now = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)

    def lease(holder: str, renewed_ago: float) -> dict[str, Any]:
        stamp = (now - dt.timedelta(seconds=renewed_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"spec": {"holderIdentity": holder, "renewTime": stamp, "leaseDurationSeconds": 15}}

    assert orphans.lease_alive(lease("op_1", 3), now)
    assert orphans.lease_alive(lease("op_1", 18), now)  # within the skew allowance
    assert not orphans.lease_alive(lease("op_1", 60), now)
    assert not orphans.lease_alive(lease("", 1), now)  # released on a clean stop (ReleaseOnCancel)
