"""Installs Tether's CRDs into a cluster and waits until they are served."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from tether.devcluster.processes import wait_for

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def crd_dir() -> Path:
    """The top-level crds/ folder of a source checkout."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "crds").is_dir() and (parent / "pyproject.toml").exists():
            return parent / "crds"
    raise FileNotFoundError("crds/ not found next to the tether sources")


def install_crds(client: httpx.Client, directory: Path | None = None, timeout: float = 60) -> list[str]:
    """Creates or replaces every CRD in `directory`; returns their names once Established."""
    names = []
    for path in sorted((directory or crd_dir()).glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        name = crd["metadata"]["name"]
        names.append(name)
        resp = client.post(CRD_PATH, json=crd)
        if resp.status_code == 409:
            current = client.get(f"{CRD_PATH}/{name}").json()
            crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            resp = client.put(f"{CRD_PATH}/{name}", json=crd)
        if resp.status_code >= 400:
            raise RuntimeError(f"installing {path.name} failed: {resp.status_code} {resp.text}")
    for name in names:
        wait_for(lambda: _established(client, name), timeout=timeout, what=f"CRD {name} Established")
    return names


def _established(client: httpx.Client, name: str) -> bool:
    conds = client.get(f"{CRD_PATH}/{name}").json().get("status", {}).get("conditions", [])
    return any(c["type"] == "Established" and c["status"] == "True" for c in conds)
