"""The CRDs' OpenAPI schemas as test oracles: values they admit (hypothesis strategies) and what
the API server's structural validation would refuse. Derived from crds/, so tests follow the CRDs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from tether.devcluster.crds import read_crd

CRDS = Path(__file__).resolve().parents[2] / "crds"


def openapi_schema(crd_file: str) -> dict[str, Any]:
    crd = read_crd(CRDS / crd_file)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def from_schema(schema: dict[str, Any], path: str = "",
                overrides: dict[str, st.SearchStrategy[Any]] | None = None) -> st.SearchStrategy[Any]:
    """Values the OpenAPI schema admits, with the bounds drawn often (that is where overflows live).
    `overrides` gives strategies by path (".template") for schemaless (preserve-unknown-fields) parts."""
    overrides = overrides or {}
    if path in overrides:
        return overrides[path]
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema["minimum"], schema["maximum"]
        return st.sampled_from([lo, hi]) | st.integers(lo, hi)
    if kind == "number":
        lo, hi = float(schema["minimum"]), float(schema["maximum"])
        return st.sampled_from([lo, hi]) | st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 30), 30))
    if kind == "array":
        return st.lists(from_schema(schema["items"], path + "[]", overrides), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", []))
        props = {name: from_schema(sub, f"{path}.{name}", overrides) for name, sub in schema["properties"].items()}
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    raise AssertionError(f"no strategy for the schema at {path or '.'}: {schema}")


def schema_violations(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """What the API server's structural validation would refuse (types, bounds, sizes, enums)."""
    if value is None:
        return [] if schema.get("nullable") else [f"{path}: null"]
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    problems: list[str] = []
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} not in {schema['enum']}")
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return [f"{path}: {value!r} is not an integer"]
    if kind in ("integer", "number"):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{path}: {value} > maximum {schema['maximum']}")
    if kind == "string":
        if not isinstance(value, str):
            return [f"{path}: {value!r} is not a string"]
        if len(value) > schema.get("maxLength", math.inf):
            problems.append(f"{path}: {len(value)} characters > maxLength {schema['maxLength']}")
        if schema.get("format") == "date-time" and not 0 < int(value[:4]) <= 9999:
            problems.append(f"{path}: {value} is not an RFC 3339 time")
    if kind == "array":
        if len(value) > schema.get("maxItems", math.inf):
            problems.append(f"{path}: {len(value)} items > maxItems {schema['maxItems']}")
        for i, item in enumerate(value):
            problems += schema_violations(item, schema["items"], f"{path}[{i}]")
    if kind == "object":
        for name, sub in value.items():
            if name in schema.get("properties", {}):
                problems += schema_violations(sub, schema["properties"][name], f"{path}.{name}")
            elif isinstance(schema.get("additionalProperties"), dict):
                problems += schema_violations(sub, schema["additionalProperties"], f"{path}.{name}")
            else:
                problems.append(f"{path}.{name}: not in the schema (it would be pruned)")
    return problems
