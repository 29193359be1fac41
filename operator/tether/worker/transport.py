"""How a worker reaches Tether: the Kubernetes API (pods) or the gateway (anywhere).

Both give the same two operations, so WorkerRun's logic (self-fencing, signals,
failure classes) is one piece of code:
  renew(checkpoint, usage) -> Renewal     one conditional lease renewal
  publish(field, value)    -> bool        one fenced status write (False: rejected)
Both raise httpx.HTTPError when there is no answer (ownership unknown, not lost).
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from tether.api import constants as c
from tether.api.models import Signals
from tether.kube import config as kubeconfig
from tether.kube.client import lease_path, run_path

JSON_PATCH = {"Content-Type": "application/json-patch+json"}


@dataclass(frozen=True)
class Renewal:
    ok: bool
    lost: bool = False
    why: str = ""
    signals: Signals | None = None


class Transport(Protocol):
    def renew(self, checkpoint: str | None, usage: dict[str, int] | None) -> Renewal: ...

    def publish(self, field: str, value: dict[str, Any]) -> bool: ...

    def close(self) -> None: ...


class KubeTransport:
    """The pod worker's path: a resourceVersion-conditional Lease update, a fenced JSON patch."""

    def __init__(self, namespace: str, name: str, holder: str, fence: int, cfg: kubeconfig.KubeConfig,
                 timeout: float) -> None:
        self.namespace, self.name, self.holder, self.fence = namespace, name, holder, fence
        self._http = cfg.sync_client(timeout=timeout)
        self._lease: dict[str, Any] | None = None

    def close(self) -> None:
        self._http.close()

    def _get_lease(self) -> dict[str, Any] | None:
        resp = self._http.get(lease_path(self.namespace, self.name))
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    def _is_mine(self, lease: dict[str, Any] | None) -> bool:
        spec = (lease or {}).get("spec") or {}
        return spec.get("holderIdentity") == self.holder and spec.get("leaseTransitions") == self.fence

    def renew(self, checkpoint: str | None, usage: dict[str, int] | None, retry_conflict: bool = True) -> Renewal:
        lease = self._lease if self._lease is not None else self._get_lease()
        if not self._is_mine(lease):
            return Renewal(ok=False, lost=True,
                           why="the lease names another holder or fence" if lease else "the lease is gone")
        assert lease is not None
        body = copy.deepcopy(lease)
        body["spec"]["renewTime"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        ann = body["metadata"].setdefault("annotations", {}) or {}
        body["metadata"]["annotations"] = ann
        if checkpoint is not None:
            ann[c.ANN_CHECKPOINT] = checkpoint
        if usage is not None:
            ann[c.ANN_USAGE] = json.dumps(usage, separators=(",", ":"))
        resp = self._http.put(lease_path(self.namespace, self.name), json=body)
        if resp.status_code == 200:
            self._lease = resp.json()
            return Renewal(ok=True, signals=_lease_signals(self._lease))
        if resp.status_code == 409:
            # Re-read: still our holder and fence means someone touched the lease harmlessly
            # (the operator updating the signals); retry once.
            self._lease = self._get_lease()
            if self._is_mine(self._lease) and retry_conflict:
                return self.renew(checkpoint, usage, retry_conflict=False)
            if not self._is_mine(self._lease):
                return Renewal(ok=False, lost=True, why="renewal conflicted and the lease is no longer ours")
            return Renewal(ok=False, why="renewal conflicted twice")
        if resp.status_code == 404:
            return Renewal(ok=False, lost=True, why="the lease is gone")
        return Renewal(ok=False, why=f"renewal refused: {resp.status_code} {resp.text[:200]}")

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        patch = [{"op": "test", "path": "/status/fence", "value": self.fence},
                 {"op": "test", "path": "/status/holder", "value": self.holder},
                 {"op": "add", "path": f"/status/{field}", "value": value}]
        resp = self._http.patch(run_path(self.namespace, self.name) + "/status", json=patch, headers=JSON_PATCH)
        if resp.status_code == 200:
            return True
        if resp.status_code in (409, 422, 404):
            return False
        resp.raise_for_status()
        return False


def _lease_signals(lease: dict[str, Any]) -> Signals | None:
    raw = ((lease.get("metadata") or {}).get("annotations") or {}).get(c.ANN_SIGNALS)
    if not raw:
        return Signals()
    try:
        return Signals.model_validate_json(raw)
    except ValueError:
        return None


class GatewayTransport:
    """The external worker's path: the same operations as JSON calls to the Tether gateway."""

    def __init__(self, base_url: str, namespace: str, name: str, token: str, holder: str, fence: int,
                 timeout: float, verify: Any = True) -> None:
        self.holder, self.fence = holder, fence
        self._prefix = f"/api/v1/namespaces/{namespace}/workerruns/{name}"
        self._http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=timeout, verify=verify)
        self.tool_claim: dict[str, Any] | None = None

    def close(self) -> None:
        self._http.close()

    def renew(self, checkpoint: str | None, usage: dict[str, int] | None) -> Renewal:
        body: dict[str, Any] = {"holder": self.holder, "fence": self.fence}
        if checkpoint is not None:
            body["checkpoint"] = checkpoint
        if usage is not None:
            body["usage"] = usage
        resp = self._http.post(f"{self._prefix}/heartbeat", json=body)
        if resp.status_code == 200:
            doc = resp.json()
            self.tool_claim = doc.get("toolClaim") or self.tool_claim
            return Renewal(ok=True, signals=gateway_signals(doc, usage))
        if resp.status_code in (404, 410):
            return Renewal(ok=False, lost=True, why=resp.json().get("error", {}).get("message", "stale fence"))
        return Renewal(ok=False, why=f"heartbeat refused: {resp.status_code} {resp.text[:200]}")

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        op, body = ("complete", {"result": value}) if field == "result" else ("fail", {"error": value})
        resp = self._http.post(f"{self._prefix}/{op}", json={"holder": self.holder, "fence": self.fence, **body})
        if resp.status_code == 200:
            return True
        if resp.status_code in (404, 409, 410):
            return False
        resp.raise_for_status()
        return False


def gateway_signals(doc: dict[str, Any], usage: dict[str, int] | None) -> Signals:
    """The gateway's flat reply as the SDK's signals (caps counted against the reported usage)."""
    own_c, own_t = (usage or {}).get("cents", 0), (usage or {}).get("tokens", 0)
    cents, tokens = doc.get("capRemainingCents"), doc.get("capRemainingTokens")
    return Signals(stop=bool(doc.get("stop")), paused=bool(doc.get("paused")), ends_at=doc.get("endsAt"),
                   cap_cents=None if cents is None else cents + own_c,
                   cap_tokens=None if tokens is None else tokens + own_t)
