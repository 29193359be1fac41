"""hack/template_schema.py on a small OpenAPI document of its own: what it makes of the pod
template's schema, and that it rewrites only its own lines of the CRD (the cluster test checks the
committed CRD against the API server's real document)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.scripts import load_script

gen = load_script("hack/template_schema.py")

REF = "#/components/schemas/"
OPENAPI: dict[str, Any] = {"components": {"schemas": {
    "io.k8s.api.core.v1.PodTemplateSpec": {"type": "object", "properties": {
        "metadata": {"allOf": [{"$ref": REF + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}], "default": {}},
        "spec": {"description": "Specification of the pod.", "default": {},
                 "allOf": [{"$ref": REF + "io.k8s.api.core.v1.PodSpec"}]}}},
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta": {"type": "object", "properties": {
        "name": {"type": "string"}, "managedFields": {"type": "array", "items": {"type": "object"}}}},
    "io.k8s.api.core.v1.PodSpec": {"description": "PodSpec is a description of a pod.", "type": "object",
                                   "required": ["containers"], "properties": {
        "containers": {"description": "Containers.", "type": "array",
                       "items": {"default": {}, "allOf": [{"$ref": REF + "io.k8s.api.core.v1.Container"}]},
                       "x-kubernetes-list-map-keys": ["name"], "x-kubernetes-list-type": "map",
                       "x-kubernetes-patch-merge-key": "name", "x-kubernetes-patch-strategy": "merge"},
        "nodeSelector": {"description": "Selector.", "type": "object", "additionalProperties": {"type": "string"},
                         "x-kubernetes-map-type": "atomic"},
        "overhead": {"description": "Overhead.", "type": "object", "additionalProperties": {
            "$ref": REF + "io.k8s.apimachinery.pkg.api.resource.Quantity"}},
        "activeDeadlineSeconds": {"description": "Seconds.", "type": "integer", "format": "int64"}}},
    "io.k8s.api.core.v1.Container": {"description": "A container.", "type": "object", "required": ["name"],
                                     "properties": {
        "name": {"description": "Name.", "type": "string", "default": ""},
        "imagePullPolicy": {"description": "Policy.", "type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
        "port": {"description": "A port.", "allOf": [{"$ref": REF + "io.k8s.apimachinery.pkg.util.intstr.IntOrString"}]},
        "protocol": {"description": "Protocol.", "type": "string", "default": "TCP"}}},
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"description": "IntOrString.", "format": "int-or-string",
                                                        "oneOf": [{"type": "integer"}, {"type": "string"}]},
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"description": "Quantity.",
                                                      "oneOf": [{"type": "string"}, {"type": "number"}]},
}}}


def _keys(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        return set(schema) | {k for v in schema.values() for k in _keys(v)}
    if isinstance(schema, list):
        return {k for v in schema for k in _keys(v)}
    return set()


def test_the_pod_template_becomes_a_structural_schema_without_defaults_or_merge_rules() -> None:
    props = gen.template_properties(OPENAPI)
    spec = props["spec"]
    assert spec["description"] == "Specification of the pod." and "required" not in spec  # the CRD's rule asks
    container = spec["properties"]["containers"]["items"]
    assert container["required"] == ["name"] and container["description"] == "A container."
    assert container["properties"]["imagePullPolicy"]["enum"] == ["Always", "IfNotPresent", "Never"]
    assert container["properties"]["port"] == {"description": "A port.", "x-kubernetes-int-or-string": True}
    quantity = spec["properties"]["overhead"]["additionalProperties"]
    assert quantity["x-kubernetes-preserve-unknown-fields"] is True and quantity["pattern"] == gen.QUANTITY_PATTERN
    assert spec["properties"]["activeDeadlineSeconds"] == {"description": "Seconds.", "type": "integer",
                                                           "format": "int64"}
    # Defaults would be applied on read to runs stored before; the template is one value, never merged.
    assert not _keys(props) & {"default", "$ref", "allOf", "oneOf", "x-kubernetes-list-type",
                               "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-patch-strategy",
                               "x-kubernetes-patch-merge-key"}
    # Only labels and annotations of the pod's metadata are the template's to give.
    assert set(props["metadata"]["properties"]) == {"labels", "annotations"}


def test_a_recursive_schema_is_refused() -> None:
    schemas = {"A": {"type": "object", "properties": {"a": {"$ref": REF + "A"}}}}
    with pytest.raises(ValueError, match="recursive schema A"):
        gen.structural(schemas, schemas["A"], ("A",))


def test_only_the_lines_between_the_markers_are_rewritten() -> None:
    crd = ("spec:\n"
           "  template:\n"
           "    type: object\n"
           "    description: kept  # and its comment\n"
           f"    {gen.BEGIN} from kube-apiserver v0: do not edit\n"
           "    properties: {old: {type: string}}\n"
           f"    {gen.END}\n"
           "  payload: {type: object}\n")
    out = gen.spliced(crd, {"spec": {"type": "object", "description": "new"}}, "v1.99.0")
    lines = out.splitlines()
    assert lines[:4] == crd.splitlines()[:4] and lines[-2:] == crd.splitlines()[-2:]
    assert lines[4] == f"    {gen.BEGIN} from kube-apiserver v1.99.0 (io.k8s.api.core.v1.PodTemplateSpec): do not edit"
    assert yaml.safe_load(out)["spec"]["template"] == {"type": "object", "description": "kept",
                                                       "properties": {"spec": {"type": "object", "description": "new"}}}
    assert gen.spliced(out, {"spec": {"type": "object", "description": "new"}}, "v1.99.0") == out  # idempotent
