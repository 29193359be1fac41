"""The pydantic models and the CRD schema describe the same fields."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tether.api.models import WorkerRunSpec, WorkerRunStatus
from tether.devcluster.crds import read_crd

CRD = read_crd(Path(__file__).parents[3] / "crds" / "workerruns.tether.dev.yaml")
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside Optional[...] / list[...], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _compare(model: type[BaseModel], schema: dict[str, Any], path: str, problems: list[str]) -> None:
    if schema.get("type") == "array":
        schema = schema["items"]
    props = schema.get("properties", {})
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    for missing in sorted(set(props) - set(fields)):
        problems.append(f"{path}.{missing}: in the CRD, not in {model.__name__}")
    for extra in sorted(set(fields) - set(props)):
        problems.append(f"{path}.{extra}: in {model.__name__}, not in the CRD")
    for name in sorted(set(props) & set(fields)):
        sub_model = _model_of(fields[name].annotation)
        sub_schema = props[name]
        if sub_model is not None and not sub_schema.get("x-kubernetes-preserve-unknown-fields"):
            _compare(sub_model, sub_schema, f"{path}.{name}", problems)


def test_spec_model_matches_schema() -> None:
    problems: list[str] = []
    _compare(WorkerRunSpec, SCHEMA["spec"], "spec", problems)
    assert not problems, problems


def test_status_model_matches_schema() -> None:
    problems: list[str] = []
    _compare(WorkerRunStatus, SCHEMA["status"], "status", problems)
    assert not problems, problems


def test_enums_match() -> None:
    from tether.api.models import Outcome, Phase

    status = SCHEMA["status"]["properties"]
    assert set(status["phase"]["enum"]) == {p.value for p in Phase}
    assert set(status["attempts"]["items"]["properties"]["outcome"]["enum"]) == {o.value for o in Outcome}


def test_defaults_match() -> None:
    lease = SCHEMA["spec"]["properties"]["lease"]
    spec = WorkerRunSpec()
    for name, prop in lease["properties"].items():
        assert prop["default"] == spec.lease.dump()[name]
    retry = SCHEMA["spec"]["properties"]["retry"]["properties"]
    assert retry["maxAttempts"]["default"] == spec.retry.max_attempts
    backoff = retry["backoff"]["properties"]
    assert backoff["initialSeconds"]["default"] == spec.retry.backoff.initial_seconds
    assert backoff["maxSeconds"]["default"] == spec.retry.backoff.max_seconds
    assert backoff["factor"]["default"] == spec.retry.backoff.factor




def test_what_a_class_may_default_has_no_default_of_the_crds() -> None:
    """A run takes its WorkerClass's default for what it leaves out; a CRD default would fill it in first."""
    from tether.api.workerclass import BY_KEY_FIELDS, WHOLE_FIELDS

    spec = SCHEMA["spec"]["properties"]
    assert [n for n in WHOLE_FIELDS + BY_KEY_FIELDS if "default" in spec[n]] == []
    assert [f"{n}.{k}" for n in BY_KEY_FIELDS for k, p in spec[n]["properties"].items() if "default" in p] == []


def test_workerclass_model_matches_its_crd() -> None:
    from tether.api.workerclass import WorkerClassSpec

    crd = read_crd(Path(__file__).parents[3] / "crds" / "workerclasses.tether.dev.yaml")
    problems: list[str] = []
    _compare(WorkerClassSpec, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"], "spec",
             problems)
    assert not problems, problems


def test_the_schedule_models_match_their_crd() -> None:
    from tether.schedules.api import RunTemplate, WorkerRunScheduleSpec, WorkerRunScheduleStatus

    crd = read_crd(Path(__file__).parents[3] / "crds" / "workerrunschedules.tether.dev.yaml")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    problems: list[str] = []
    _compare(WorkerRunScheduleSpec, schema["spec"], "spec", problems)
    _compare(WorkerRunScheduleStatus, schema["status"], "status", problems)
    _compare(RunTemplate, schema["spec"]["properties"]["runTemplate"], "spec.runTemplate", problems)
    assert not problems, problems
