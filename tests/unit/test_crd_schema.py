"""Static checks of the CRDs: what `kubectl explain` shows must teach the user."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

CRDS = sorted((Path(__file__).parents[2] / "crds").glob("*.yaml"))


def _walk(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


@pytest.mark.parametrize("crd_file", CRDS, ids=[p.name for p in CRDS])
def test_every_field_has_a_description(crd_file: Path) -> None:
    crd = yaml.safe_load(crd_file.read_text())
    for version in crd["spec"]["versions"]:
        root = version["schema"]["openAPIV3Schema"]
        missing = [p for p, s in _walk(root, "") if p not in (".metadata",) and p and not s.get("description")]
        assert not missing, f"{crd_file.name}: fields without description: {missing}"


def test_crds_exist() -> None:
    assert any(p.name == "workerruns.tether.dev.yaml" for p in CRDS)
