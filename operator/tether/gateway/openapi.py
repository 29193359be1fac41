"""The gateway's OpenAPI 3.1 document, generated from its pydantic models."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from tether.gateway import models as m

_REQUESTS: dict[str, type[BaseModel]] = {
    "claim": m.ClaimRequest, "heartbeat": m.HeartbeatRequest, "checkpoint": m.CheckpointRequest,
    "complete": m.CompleteRequest, "fail": m.FailRequest, "cancel": m.CancelRequest, "approval": m.ApprovalRequest,
    "spawn": m.SpawnRequest, "child": m.ChildRequest,
}
_RESPONSES: dict[str, type[BaseModel]] = {
    "claim": m.ClaimResponse, "heartbeat": m.Signals, "checkpoint": m.Signals,
    "complete": m.Done, "fail": m.Done, "cancel": m.Done, "approval": m.ApprovalResponse,
    "spawn": m.ChildReply, "child": m.ChildReply,
}
_SUMMARIES = {
    "claim": "Take the run's open attempt: returns holder, fence, lease and a tool credential.",
    "heartbeat": "Renew the lease; carries usage and checkpoint; returns the control signals.",
    "checkpoint": "Record progress (a renewal too).",
    "complete": "Publish the result (fenced).",
    "fail": "Publish a failure (fenced); retry rules decide what follows.",
    "cancel": "Give the attempt up (fenced); another worker may claim the next one.",
    "approval": "Ask a person to approve a step (a renewal too); the decision comes back here and in "
                "every later heartbeat reply, for this attempt only.",
    "spawn": "Create a child run in this attempt's name (or find the one of this key); 422 SpawnRefused with the "
             "API server's reason.",
    "child": "Read one of this run's children (404 ChildNotFound: none of that name).",
}
_ERRORS = {
    "401": "No valid bearer token (TokenReview, audience checked).",
    "403": "RBAC does not allow verb `claim` on this workerrun (SubjectAccessReview), or "
           "(`NotClaimant`) the attempt was claimed by another identity, or not claimed yet.",
    "404": "No such workerrun, or (`ChildNotFound`, on `child`) no child of it by that name.",
    "409": "Held by another worker, or no attempt open to claim.",
    "402": "Budget exceeded: the run is not admitted.",
    "410": "The fence is stale: another attempt owns the run now.",
    "413": "The body is larger than the gateway accepts (1 MiB by default), or (`ResultTooLarge`, on `complete` and "
           "`fail`) the value would make the WorkerRun larger than the Kubernetes API stores: a bad result.",
    "422": "Malformed body (not JSON, nested too deep, or invalid); `error.field` names the field; "
           "(`SpawnRefused`, on `spawn`) the API server refused the child.",
    "500": "A bug in the gateway; it is logged.",
    "502": "The Kubernetes API refused the gateway's own request.",
    "503": "The Kubernetes API cannot be reached; retry after `Retry-After` seconds.",
}
_HEADERS = {"503": {"Retry-After": {"description": "Seconds to wait before retrying.", "required": True,
                                    "schema": {"type": "integer", "minimum": 1}}}}


def _schemas() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in list(_REQUESTS.values()) + list(_RESPONSES.values()) + [m.ErrorEnvelope]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            out[name] = sub
        out[model.__name__] = schema
    return out


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    paths: dict[str, Any] = {}
    params = [{"name": "namespace", "in": "path", "required": True, "schema": {"type": "string"}},
              {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    for op, req in _REQUESTS.items():
        errors = {code: {"description": text, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}},
            **({"headers": _HEADERS[code]} if code in _HEADERS else {})}
            for code, text in _ERRORS.items() if code != "402" or op == "claim"}
        paths[f"/api/v1/namespaces/{{namespace}}/workerruns/{{name}}/{op}"] = {"post": {
            "operationId": op, "summary": _SUMMARIES[op], "parameters": params,
            "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{req.__name__}"}}}},
            "responses": {"200": {"description": "OK", "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{_RESPONSES[op].__name__}"}}}}, **errors},
        }}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tether gateway", "version": "v1",
                 "description": "Nine calls for workers outside the cluster, on the same fenced Lease and "
                                "status operations as pod workers."},
        "paths": paths,
        "components": {"schemas": _schemas(),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "A Kubernetes token (TokenReview)."}}},
    }
