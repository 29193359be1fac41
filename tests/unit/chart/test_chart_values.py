"""The chart's values.schema.json describes every value of values.yaml, as values.yaml's comments do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "tether"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    """The node with its `$ref` (into this schema's definitions) merged in; the node's own keys win."""
    ref = node.get("$ref")
    if ref is None:
        return node
    target: Any = SCHEMA
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return {**_resolve(target), **{k: v for k, v in node.items() if k != "$ref"}}


def _leaves(values: dict[str, Any], schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every value of values.yaml with its schema: maps the schema spells out are walked into."""
    for key, value in values.items():
        here = f"{path}.{key}" if path else key
        assert key in schema.get("properties", {}), f"{here} is in values.yaml but not in values.schema.json"
        node = _resolve(schema["properties"][key])
        if isinstance(value, dict) and value and "properties" in node:
            yield from _leaves(value, node, here)
        else:
            yield here, node


def _comments() -> dict[str, str]:
    """Each value's `# --` comment in values.yaml (with its continuation lines), by dotted path."""
    out: dict[str, str] = {}
    stack: list[str] = []
    pending: list[str] = []
    for line in (CHART / "values.yaml").read_text().splitlines():
        text = line.strip()
        if not text:
            pending = []
        elif text.startswith("#"):
            comment = text.lstrip("#").strip()
            if comment.startswith("--"):
                pending = [comment[2:].strip()]
            elif pending:
                pending.append(comment)
        else:
            stack = stack[:(len(line) - len(line.lstrip())) // 2] + [text.split(":", 1)[0]]
            if pending:
                out[".".join(stack)] = " ".join(pending)
            pending = []
    return out


def test_every_value_has_a_description_in_the_schema() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    leaves = dict(_leaves(values, SCHEMA))
    assert "resources.limits.memory" in leaves and "podSecurityContext.runAsUser" in leaves
    undescribed = [path for path, node in leaves.items() if not node.get("description", "").strip()]
    assert undescribed == []


def test_schema_descriptions_are_the_values_comments() -> None:
    """`helm show values` shows the comments, editors the schema: both say the same."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    leaves = dict(_leaves(values, SCHEMA))
    differing = {path: (text, leaves[path].get("description")) for path, text in _comments().items()
                 if path in leaves and leaves[path].get("description") != text}
    assert differing == {}


def test_kubernetes_shaped_values_have_real_schemas() -> None:
    props = SCHEMA["properties"]
    for name in ("resources", "affinity", "podSecurityContext", "securityContext"):
        assert props[name].get("additionalProperties") is False and props[name]["properties"], name
    for name in ("tolerations", "topologySpreadConstraints", "extraEnv", "imagePullSecrets"):
        assert props[name]["items"].get("additionalProperties") is False, name
    quantity = _resolve(_resolve(props["resources"]["properties"]["limits"])["properties"]["memory"])
    assert "pattern" in quantity
