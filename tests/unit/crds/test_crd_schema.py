"""Static checks of the CRDs: what `kubectl explain` shows must teach the user."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from tether.devcluster.crds import read_crd

CRDS = sorted((Path(__file__).parents[3] / "crds").glob("*.yaml"))


def _walk(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


# spec.template is the pod template's own schema (hack/template_schema.py): its numbers are bounded by
# the pod's validation when the attempt's pod is created (out of range: PodRefused), and the operator
# does no arithmetic on them; its OpenAPI describes fields, not the items of their lists and maps.
# (A schedule's runTemplate.spec.template is the same schema.)
POD_TEMPLATE = ".spec.template."


def _item_of_the_pods_own(path: str) -> bool:
    """A list item or map value in the pod's schema: `kubectl explain` shows its field's description."""
    return POD_TEMPLATE in path and path.endswith(("[]", "{}"))


@pytest.mark.parametrize("crd_file", CRDS, ids=[p.name for p in CRDS])
def test_every_field_has_a_description(crd_file: Path) -> None:
    crd = read_crd(crd_file)
    for version in crd["spec"]["versions"]:
        root = version["schema"]["openAPIV3Schema"]
        missing = [p for p, s in _walk(root, "") if p not in (".metadata",) and p and not s.get("description")
                   and not _item_of_the_pods_own(p)]
        assert not missing, f"{crd_file.name}: fields without description: {missing}"


@pytest.mark.parametrize("crd_file", CRDS, ids=[p.name for p in CRDS])
def test_every_schema_says_only_what_a_schema_can_hold(crd_file: Path) -> None:
    """A comma in an unquoted flow-mapping description (`{description: A, b.}`) makes `b.` a key:
    the API server only warns and drops it, and `kubectl explain` shows the description cut short.
    (Found by the chart's install on kind, whose helm prints the API server's warnings.)"""
    from kubernetes.client import V1JSONSchemaProps

    allowed = set(V1JSONSchemaProps.attribute_map.values())
    crd = read_crd(crd_file)
    for version in crd["spec"]["versions"]:
        unknown = {p: sorted(set(s) - allowed) for p, s in _walk(version["schema"]["openAPIV3Schema"], "")
                   if set(s) - allowed}
        assert not unknown, f"{crd_file.name} {version['name']}: keys no JSONSchemaProps has: {unknown}"


def test_crds_exist() -> None:
    assert any(p.name == "workerruns.tether.dev.yaml" for p in CRDS)


def _numeric_fields(crd_file: Path) -> list[tuple[str, dict[str, Any]]]:
    crd = read_crd(crd_file)
    return [(p, s) for version in crd["spec"]["versions"]
            for p, s in _walk(version["schema"]["openAPIV3Schema"], "")
            if s.get("type") in ("integer", "number") and POD_TEMPLATE not in p]


def _mentions(description: str, bound: int | float) -> bool:
    """The description states the bound, as plain digits (86400) or with separators (86,400)."""
    number = int(bound) if float(bound).is_integer() else bound
    return str(number) in description or f"{number:,}" in description


@pytest.mark.parametrize("crd_file", CRDS, ids=[p.name for p in CRDS])
def test_every_number_has_bounds_that_kubectl_explain_shows(crd_file: Path) -> None:
    # Issue 9: values the CRD admitted without a maximum (deadlineSeconds: 1e12) crashed the
    # operator. Every number is bounded, and `kubectl explain` tells the user the maximum.
    fields = _numeric_fields(crd_file)
    assert fields or crd_file.name == "workerrunapprovals.tether.dev.yaml"  # the only CRD with no numbers
    unbounded = [p for p, s in fields if "minimum" not in s or "maximum" not in s]
    assert not unbounded, f"{crd_file.name}: numbers without minimum/maximum: {unbounded}"
    unexplained = [p for p, s in fields if not _mentions(s["description"], s["maximum"])]
    assert not unexplained, f"{crd_file.name}: descriptions that do not state the maximum: {unexplained}"


def test_chart_crds_are_copies_of_the_top_level_crds() -> None:
    # The chart ships crds/ verbatim (tests/cluster/test_chart.py checks it too, but needs a
    # cluster run); a bound added to one copy only would be a silent divergence.
    chart = Path(__file__).parents[3] / "charts" / "tether" / "crds"
    assert {p.name: p.read_bytes() for p in CRDS} == {p.name: p.read_bytes() for p in chart.glob("*.yaml")}


def _shown(value: Any) -> str:
    """A default as YAML writes it (`false`, `90`, `Pod`)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("crd_file", CRDS, ids=[p.name for p in CRDS])
def test_every_default_is_said_where_kubectl_explain_shows_it(crd_file: Path) -> None:
    """`kubectl explain` prints descriptions, not the schema's `default`: a field's default must be
    in its description, or the user never learns that the lease is 90/30/120 unless set."""
    crd = read_crd(crd_file)
    unsaid = [p for version in crd["spec"]["versions"]
              for p, s in _walk(version["schema"]["openAPIV3Schema"], "")
              if "default" in s and not isinstance(s["default"], dict)
              and f"Defaults to {_shown(s['default'])}." not in " ".join(s.get("description", "").split())]
    assert not unsaid, f"{crd_file.name}: defaults kubectl explain does not show: {unsaid}"
