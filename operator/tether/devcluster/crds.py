"""Installs Tether's CRDs and admission policies into a cluster and waits until they are served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import yaml

from tether.devcluster.processes import wait_for

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


ADMISSION_PATH = "/apis/admissionregistration.k8s.io/v1"
ADMISSION_COLLECTIONS = {
    "ValidatingAdmissionPolicy": f"{ADMISSION_PATH}/validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": f"{ADMISSION_PATH}/validatingadmissionpolicybindings",
}
# The release the README installs (`helm install tether charts/tether --namespace tether-system`): its
# policies have the plain manifests' names (tether-*), and Helm adopts an existing object only when it
# carries this label and these annotations (helm.sh/helm pkg/action/validate.go, checkOwnership).
HELM_RELEASE, HELM_RELEASE_NAMESPACE = "tether", "tether-system"
HELM_OWNERSHIP = {
    "labels": {"app.kubernetes.io/managed-by": "Helm"},
    "annotations": {"meta.helm.sh/release-name": HELM_RELEASE, "meta.helm.sh/release-namespace": HELM_RELEASE_NAMESPACE},
}


def _top_level_dir(name: str) -> Path:
    for parent in Path(__file__).resolve().parents:
        if (parent / name).is_dir() and (parent / "pyproject.toml").exists():
            return parent / name
    raise FileNotFoundError(f"{name}/ not found next to the tether sources")


def crd_dir() -> Path:
    """The top-level crds/ folder of a source checkout."""
    return _top_level_dir("crds")


def policy_dir() -> Path:
    """The top-level policies/ folder (ValidatingAdmissionPolicies) of a source checkout."""
    return _top_level_dir("policies")


def read_crd(path: Path) -> dict[str, Any]:
    """A CRD file, parsed by libyaml when PyYAML has it: the WorkerRun CRD (a pod template's whole
    schema, 650 KB) takes seconds of CPU to parse in pure Python, on every cluster start and test."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd: dict[str, Any] = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    return crd


def install_crds(client: httpx.Client, directory: Path | None = None, timeout: float = 60) -> list[str]:
    """Creates or replaces every CRD in `directory`; returns their names once Established."""
    names = []
    for path in sorted((directory or crd_dir()).glob("*.yaml")):
        crd = read_crd(path)
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


def create_or_replace(client: httpx.Client, collection: str, obj: dict[str, Any]) -> None:
    name = obj["metadata"]["name"]
    resp = client.post(collection, json=obj)
    if resp.status_code == 409:
        current = client.get(f"{collection}/{name}").json()
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
        resp = client.put(f"{collection}/{name}", json=obj)
    if resp.status_code >= 400:
        raise RuntimeError(f"installing {obj['kind']} {name} failed: {resp.status_code} {resp.text}")


def install_policies(client: httpx.Client, directory: Path | None = None,
                     timeout: float = 60) -> dict[str, list[str]]:
    """Creates or replaces every admission policy and binding in `directory`.

    Each carries Helm's ownership metadata for release `tether` in `tether-system`, so that the chart
    installed as the README installs it adopts (and replaces) them instead of refusing to install.
    Returns each policy's type-checking warnings once the API server has checked it
    (status.observedGeneration caught up): expressions that do not fit the matched
    resources' schemas show up there, not as errors.
    """
    policies: list[str] = []
    for path in sorted((directory or policy_dir()).glob("*.yaml")):
        for obj in yaml.safe_load_all(path.read_text()):
            if not obj:
                continue
            collection = ADMISSION_COLLECTIONS.get(obj.get("kind", ""))
            if collection is None:
                raise RuntimeError(f"{path.name}: unexpected kind {obj.get('kind')!r}")
            create_or_replace(client, collection, _adoptable(obj))
            if obj["kind"] == "ValidatingAdmissionPolicy":
                policies.append(obj["metadata"]["name"])
    warnings: dict[str, list[str]] = {}
    for name in policies:
        url = f"{ADMISSION_COLLECTIONS['ValidatingAdmissionPolicy']}/{name}"
        wait_for(lambda: _type_checked(client, url), timeout=timeout, what=f"policy {name} type-checked")
        checking = client.get(url).json().get("status", {}).get("typeChecking") or {}
        warnings[name] = [w["warning"] for w in checking.get("expressionWarnings") or []]
    return warnings


def _adoptable(obj: dict[str, Any]) -> dict[str, Any]:
    meta = dict(obj["metadata"])
    for key, extra in HELM_OWNERSHIP.items():
        meta[key] = {**meta.get(key, {}), **extra}
    return {**obj, "metadata": meta}


def _type_checked(client: httpx.Client, url: str) -> bool:
    policy = client.get(url).json()
    return policy.get("status", {}).get("observedGeneration") == policy["metadata"].get("generation")
