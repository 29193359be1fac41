"""The API server enforces the WorkerRun contract: CEL rules and schema, no operator needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testkit.kube import Kube, refused


def _run(name: str = "r", **spec: object) -> dict:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", "payload": {"n": 1}, **spec}}


def _started(kube: Kube, ns: str) -> str:
    kube.ok(kube.post(Kube.wr_path(ns), _run()))
    path = Kube.wr_path(ns, "r")
    kube.ok(kube.patch(path + "/status", {"status": {"attempt": 1, "fence": 1, "holder": "r-a1", "phase": "Running"}}))
    return path


def test_defaults_are_applied(kube: Kube, namespace: str) -> None:
    run = kube.ok(kube.post(Kube.wr_path(namespace), _run()))
    assert run["spec"]["stop"] is False and run["spec"]["executor"] == "External"
    # What a WorkerClass may give a run is left out, so that its class's can be told apart.
    assert not {"lease", "retry", "stopGraceSeconds"} & set(run["spec"])
    lease = kube.ok(kube.post(Kube.wr_path(namespace), _run("l", lease={"durationSeconds": 70})))["spec"]["lease"]
    assert lease == {"durationSeconds": 70, "renewIntervalSeconds": 30, "startupGraceSeconds": 120}


def test_execution_fields_are_immutable_once_started(kube: Kube, namespace: str) -> None:
    path = _started(kube, namespace)
    refused(kube.patch(path, {"spec": {"payload": {"n": 2}}}), "spec.payload", "immutable once the run has started")
    refused(kube.patch(path, {"spec": {"lease": {"durationSeconds": 300}}}))
    # Control fields stay mutable.
    assert kube.ok(kube.patch(path, {"spec": {"stop": True, "suspend": True, "budget": {"capCents": 900}}}))["spec"]["stop"]


def test_execution_fields_are_mutable_before_start(kube: Kube, namespace: str) -> None:
    kube.ok(kube.post(Kube.wr_path(namespace), _run()))
    assert kube.ok(kube.patch(Kube.wr_path(namespace, "r"), {"spec": {"payload": {"n": 2}}}))["spec"]["payload"] == {"n": 2}


def test_fence_never_decreases(kube: Kube, namespace: str) -> None:
    path = _started(kube, namespace)
    refused(kube.patch(path + "/status", {"status": {"fence": 0}}), "status.fence never decreases")
    assert kube.ok(kube.get(path))["status"]["fence"] == 1


def test_retry_rule_needs_exactly_one_matcher(kube: Kube, namespace: str) -> None:
    refused(kube.post(Kube.wr_path(namespace), _run(retry={"rules": [{"action": "Retry"}]})), "spec.retry.rules[0]")


# --- issue 9: bounds, names, budgetRef, deadlineSeconds ---------------------------------


@pytest.mark.parametrize(("spec", "field", "maximum"), [
    ({"deadlineSeconds": 10**12}, "spec.deadlineSeconds", "31536000"),
    ({"ttlSecondsAfterFinished": 10**12}, "spec.ttlSecondsAfterFinished", "31536000"),
    ({"retry": {"backoff": {"factor": 1e300}}}, "spec.retry.backoff.factor", "100"),
    ({"retry": {"backoff": {"maxSeconds": 2**31 - 1}}}, "spec.retry.backoff.maxSeconds", "604800"),
    ({"budget": {"capCents": 2**62}}, "spec.budget.capCents", "1000000000000"),
])
def test_numbers_above_their_maximum_arerefused(kube: Kube, namespace: str, spec: dict[str, Any], field: str,
                                                 maximum: str) -> None:
    # These values used to be admitted and crashed the operator's decisions (OverflowError).
    refused(kube.post(Kube.wr_path(namespace), _run(**spec)), field, maximum)


def test_numbers_at_their_maximum_are_admitted(kube: Kube, namespace: str) -> None:
    spec = {"deadlineSeconds": 31536000, "ttlSecondsAfterFinished": 31536000, "progressDeadlineSeconds": 31536000,
            "retry": {"maxAttempts": 100, "backoff": {"initialSeconds": 86400, "maxSeconds": 604800, "factor": 100}},
            "budget": {"capCents": 10**12, "maxTokens": 10**15}}
    created = kube.ok(kube.post(Kube.wr_path(namespace), _run(**spec)))
    assert created["spec"]["retry"]["backoff"]["factor"] == 100


def test_status_numbers_are_bounded_too(kube: Kube, namespace: str) -> None:
    # The fence is mirrored into the Lease's int32 leaseTransitions: a larger one could never be granted.
    path = _started(kube, namespace)
    refused(kube.patch(path + "/status", {"status": {"fence": 2**31}}), "status.fence", "2147483647")
    assert kube.ok(kube.patch(path + "/status", {"status": {"fence": 2**31 - 1}}))["status"]["fence"] == 2**31 - 1


def test_name_longer_than_58_characters_isrefused(kube: Kube, namespace: str) -> None:
    # A longer name made each attempt's pod `<name>-a<N>` and its labels exceed 63 characters:
    # the API server answered 422 on every attempt. Now the run itself is refused, saying why.
    message = refused(kube.post(Kube.wr_path(namespace), _run("n" * 59)), "metadata.name must be at most 58 characters")
    assert "Choose a shorter name" in message
    longest = "n" * 58
    assert kube.ok(kube.post(Kube.wr_path(namespace), _run(longest)))["metadata"]["name"] == longest
    # The longest pod name this allows, and its label value, fit: attempts go up to 100.
    assert len(f"{longest}-a100") == 63


def test_generated_names_are_held_to_the_same_limit(kube: Kube, namespace: str) -> None:
    body = _run()
    body["metadata"] = {"generateName": "g" * 54}  # the API server appends 5 random characters
    refused(kube.post(Kube.wr_path(namespace), body), "metadata.name must be at most 58 characters")
    body["metadata"] = {"generateName": "g" * 53}
    assert len(kube.ok(kube.post(Kube.wr_path(namespace), body))["metadata"]["name"]) == 58


def test_budget_ref_cannot_change_or_go_once_set(kube: Kube, namespace: str) -> None:
    kube.ok(kube.post(Kube.wr_path(namespace), _run(budget={"budgetRef": {"name": "team-a"}})))
    path = Kube.wr_path(namespace, "r")
    fragments = ("spec.budget.budgetRef cannot be changed or removed once set",)
    refused(kube.patch(path, {"spec": {"budget": {"budgetRef": {"name": "team-b"}}}}), *fragments)
    refused(kube.patch(path, {"spec": {"budget": {"budgetRef": None}}}), *fragments)
    refused(kube.patch(path, {"spec": {"budget": None}}), *fragments)
    # The caps beside it stay control fields.
    capped = kube.ok(kube.patch(path, {"spec": {"budget": {"capCents": 700}}}))
    assert capped["spec"]["budget"] == {"capCents": 700, "budgetRef": {"name": "team-a"}}


def test_budget_ref_may_be_added_later(kube: Kube, namespace: str) -> None:
    path = _started(kube, namespace)
    added = kube.ok(kube.patch(path, {"spec": {"budget": {"budgetRef": {"name": "team-a"}}}}))
    assert added["spec"]["budget"]["budgetRef"] == {"name": "team-a"}


def test_deadline_stays_mutable_after_start(kube: Kube, namespace: str) -> None:
    # deadlineSeconds is a control field: the operator moves status.endsAt to follow it.
    path = _started(kube, namespace)
    assert kube.ok(kube.patch(path, {"spec": {"deadlineSeconds": 600}}))["spec"]["deadlineSeconds"] == 600
    assert "deadlineSeconds" not in kube.ok(kube.patch(path, {"spec": {"deadlineSeconds": None}}))["spec"]


def test_a_failed_ownership_test_and_a_refused_result_are_two_different_422s(kube: Kube, namespace: str) -> None:
    """What workers rely on (docs/protocol.md, "Publishing"): the API server's 422 for a `test`
    that did not hold names no field; its 422 for a value the schema refuses lists the fields."""
    from tether import protocol

    path = _started(kube, namespace) + "/status"
    stale = kube.patch(path, protocol.fenced_patch("r-a0", 0, "result", {"ok": True}), kind="json")
    assert stale.status_code == 422 and protocol.invalid_causes(stale.text) == [], stale.text
    bad = kube.patch(path, protocol.fenced_patch("r-a1", 1, "result", [1]), kind="json")  # type: ignore[arg-type]
    assert bad.status_code == 422, bad.text
    assert "status.result" in [c.get("field") for c in protocol.invalid_causes(bad.text)], bad.text
    bad_error = kube.patch(path, protocol.fenced_patch("r-a1", 1, "error", {"code": 5}), kind="json")
    assert bad_error.status_code == 422 and protocol.invalid_causes(bad_error.text)
    # Neither was applied: the holder can still publish a good result.
    assert kube.patch(path, protocol.fenced_patch("r-a1", 1, "result", {"ok": True}), kind="json").status_code == 200


def test_kubectl_explain_teaches_the_lease_rules(kube: Kube, namespace: str, bin_dir: Path) -> None:
    """docs/protocol.md §3: the lease rule, its reason and the self-fencing margin, where a user looks."""
    import subprocess

    out = subprocess.run([str(bin_dir / "kubectl"), "--kubeconfig", kube.kubeconfig_path, "explain",
                          "workerruns.spec.lease"], check=True, capture_output=True, text=True).stdout
    flat = " ".join(out.split())
    assert "durationSeconds > 2 × renewIntervalSeconds + 5" in flat and "smallest lease is 8 s" in flat, out
    assert "max(1 s, durationSeconds/10)" in flat, out
    fence = subprocess.run([str(bin_dir / "kubectl"), "--kubeconfig", kube.kubeconfig_path, "explain",
                            "workerruns.status.fence"], check=True, capture_output=True, text=True).stdout
    assert "every accepted result or error" in " ".join(fence.split()), fence
    refused(kube.post(Kube.wr_path(namespace), _run("six", lease={"durationSeconds": 6, "renewIntervalSeconds": 1})),
            "smallest is durationSeconds 8")


# --- issue 21, defect 2: the execution fields really compared -------------------------------
# CEL compared the schemaless payload and template by the keys both objects had: a renamed key
# ({"n":1,"dryRun":true} -> {"n":1,"dryRunX":true}) passed on a run that had started or waited for
# approval. Now those fields are maps of any JSON value, which CEL looks up key by key.

PAYLOAD = {"n": 1, "dryRun": True, "opts": {"a": 1}}
TEMPLATE = {"metadata": {"labels": {"app": "w"}},
            "spec": {"containers": [{"name": "w", "image": "w:1", "command": ["w"]}]}}
EDITS = {
    "payload": {
        "key renamed": {"dryRun": None, "dryRunX": True},
        "key added": {"m": 2},
        "key removed": {"dryRun": None},
        "nested change": {"opts": {"a": 2}},
        "nested key renamed": {"opts": {"a": None, "b": 1}},
        "value type": {"n": "1"},
    },
    "template": {
        "key renamed": {"metadata": {"labels": {"app": None, "App": "w"}}},
        "key added": {"spec": {"nodeSelector": {"disk": "ssd"}}},  # (a key the pod's schema lacks is refused at apply)
        "key removed": {"metadata": None},
        "nested change": {"spec": {"containers": [{"name": "w", "image": "w:2", "command": ["w"]}]}},
    },
}


def _frozen(kube: Kube, ns: str, state: str) -> str:
    """A run whose execution fields are frozen: gated and approved (waiting for its budget), or
    between its first and second attempt."""
    review = {"review": {"start": True}} if state == "approved" else {}
    kube.ok(kube.post(Kube.wr_path(ns), {**_run(), "spec": {"executor": "Pod", "payload": PAYLOAD,
                                                            "template": TEMPLATE, **review}}))
    path = Kube.wr_path(ns, "r")
    when = "2026-01-01T00:00:00Z"
    status = ({"phase": "Pending", "review": {"requests": [{"gate": "Start", "attempt": 0, "requestedAt": when,
                                                             "decision": "Approve", "approver": "alice",
                                                             "decidedAt": when}]}}
              if state == "approved" else
              {"phase": "Backoff", "attempt": 1, "fence": 2, "attempts": [{"attempt": 1, "fence": 1,
                                                                           "outcome": "PodFailed"}]})
    kube.ok(kube.patch(path + "/status", {"status": status}))
    return path


@pytest.mark.parametrize("state", ["approved", "after a grant"])
@pytest.mark.parametrize(("field", "edit"), [(f, e) for f, edits in EDITS.items() for e in edits])
def test_every_change_of_payload_and_template_is_refused_once_frozen(kube: Kube, namespace: str, state: str,
                                                                     field: str, edit: str) -> None:
    path = _frozen(kube, namespace, state)
    refused(kube.patch(path, {"spec": {field: EDITS[field][edit]}}), f"spec.{field}", "immutable once the run")
    run = kube.ok(kube.get(path))
    assert (run["spec"]["payload"], run["spec"]["template"]) == (PAYLOAD, TEMPLATE)


@pytest.mark.parametrize("state", ["approved", "after a grant"])
def test_control_fields_stay_mutable_once_frozen(kube: Kube, namespace: str, state: str) -> None:
    path = _frozen(kube, namespace, state)
    changed = kube.ok(kube.patch(path, {"spec": {"stop": True, "suspend": True, "budget": {"capCents": 900},
                                                 "deadlineSeconds": 600, "payload": PAYLOAD}}))
    assert (changed["spec"]["stop"], changed["spec"]["suspend"], changed["spec"]["budget"]) == (True, True,
                                                                                              {"capCents": 900})


def test_payload_and_template_keep_any_json_and_change_freely_before_the_start(kube: Kube, namespace: str) -> None:
    odd = {"none": None, "list": [1, None, {"x": None}], "s": "t", "f": 1.5, "nested": {"null": None}}
    created = kube.ok(kube.post(Kube.wr_path(namespace), {**_run(), "spec": {"executor": "External", "payload": odd}}))
    assert created["spec"]["payload"] == odd  # nothing pruned, as when the field was schemaless
    path = Kube.wr_path(namespace, "r")
    renamed = kube.ok(kube.patch(path, {"spec": {"payload": {"s": None, "sX": "t"}}}))["spec"]["payload"]
    assert "sX" in renamed and "s" not in renamed
    kube.ok(kube.patch(path + "/status", {"status": {"attempt": 1, "fence": 1, "holder": "r-a1"}}))
    # A run with nulls in its payload is not refused for an edit of a control field.
    assert kube.ok(kube.patch(path, {"spec": {"suspend": True}}))["spec"]["suspend"] is True
    refused(kube.post(Kube.wr_path(namespace), {**_run("s"), "spec": {"executor": "External", "payload": "x"}}),
             "spec.payload")


def test_the_execution_digest_never_changes_once_set(kube: Kube, namespace: str) -> None:
    path = _started(kube, namespace) + "/status"
    first, other = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    refused(kube.patch(path, {"status": {"executionDigest": "sha256:abc"}}), "status.executionDigest")
    assert kube.ok(kube.patch(path, {"status": {"executionDigest": first}}))["status"]["executionDigest"] == first
    refused(kube.patch(path, {"status": {"executionDigest": other}}), "status.executionDigest never changes once set")


_NO_WORKER = "spec.template is required for executor Pod"


@pytest.mark.parametrize("spec", [
    {"executor": "Pod"},
    {},  # executor defaults to Pod
    {"executor": "Pod", "template": {"metadata": {"labels": {"a": "b"}}}},
    {"executor": "Pod", "template": {"spec": {}}},
    {"executor": "Pod", "template": {"spec": {"containers": []}}},  # (the pod's schema admits it)
    {"executor": "Pod", "template": {"spec": None}},
], ids=["no-template", "default-executor", "no-spec", "no-containers", "empty-containers", "null-spec"])
def test_a_pod_run_without_a_container_is_refused_at_apply(kube: Kube, namespace: str, spec: dict[str, Any]) -> None:
    """Else it is accepted, and every attempt's pod is refused (PodRefused)."""
    run = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": "r"},
           "spec": {"payload": {"n": 1}, **spec}}
    refused(kube.post(Kube.wr_path(namespace), run), _NO_WORKER, "executor External")


def test_a_pod_run_with_a_container_and_an_external_run_without_template_are_admitted(kube: Kube,
                                                                                     namespace: str) -> None:
    pod = {"containers": [{"name": "w", "image": "worker:1"}]}
    kube.ok(kube.post(Kube.wr_path(namespace), _run("pod", executor="Pod", template={"spec": pod})))
    kube.ok(kube.post(Kube.wr_path(namespace), _run("ext")))


# --- issue 34: spec.template has the pod template's schema -------------------------------------------


def _pod_run(name: str, pod: dict[str, Any]) -> dict[str, Any]:
    return _run(name, executor="Pod", template={"spec": pod})


def test_a_typo_in_the_template_is_refused_at_kubectl_apply(kube: Kube, namespace: str, bin_dir: Path,
                                                           tmp_path: Path) -> None:
    """The template was a map of any JSON: `contianers` was stored, and the pod API dropped it unsaid."""
    import subprocess

    manifest = tmp_path / "typo.yaml"
    manifest.write_text(f"""apiVersion: tether.dev/v1alpha1
kind: WorkerRun
metadata: {{name: typo, namespace: {namespace}}}
spec:
  template:
    spec:
      containers: [{{name: w, image: "w:1"}}]
      contianers: [{{name: w, image: "w:1"}}]
""")
    applied = subprocess.run([str(bin_dir / "kubectl"), "--kubeconfig", kube.kubeconfig_path, "apply", "-f",
                              str(manifest)], capture_output=True, text=True)
    assert applied.returncode == 1, applied.stdout + applied.stderr
    assert 'unknown field "spec.template.spec.contianers"' in applied.stderr, applied.stderr
    assert kube.get(Kube.wr_path(namespace, "typo")).status_code == 404
    # A client that does not ask for strict field validation: the unknown field is dropped (with a
    # warning), and a template left without containers is refused for that.
    resp = kube.post(Kube.wr_path(namespace), _pod_run("lax", {"contianers": [{"name": "w", "image": "w:1"}]}))
    refused(resp, _NO_WORKER)
    warning = resp.headers.get("warning", "")
    assert "unknown field" in warning and "spec.template.spec.contianers" in warning, resp.headers


@pytest.mark.parametrize(("pod", "said"), [
    ({"containers": [{"name": "w", "image": "w:1", "ports": [{"containerPort": "eighty"}]}]},
     "spec.template.spec.containers[0].ports[0].containerPort"),
    ({"containers": [{"name": "w", "image": "w:1", "imagePullPolicy": "Sometimes"}]},
     "spec.template.spec.containers[0].imagePullPolicy"),
    ({"containers": [{"name": "w", "image": "w:1", "resources": {"requests": {"cpu": "lots"}}}]},
     "spec.template.spec.containers[0].resources.requests.cpu"),
], ids=["type", "enum", "quantity"])
def test_a_template_the_pod_schema_refuses_is_refused_at_apply(kube: Kube, namespace: str, pod: dict[str, Any],
                                                              said: str) -> None:
    refused(kube.post(Kube.wr_path(namespace), _pod_run("r", pod)), said)


def test_the_pod_schema_admits_what_a_pod_admits(kube: Kube, namespace: str) -> None:
    """Numbers and strings for quantities (cpu: 0.5), names for ports, and the nulls Helm renders for
    empty values (dropped, as a pod drops them)."""
    container = {"name": "w", "image": "w:1", "env": None,
                 "resources": {"requests": {"cpu": 0.5, "memory": "1Gi"}, "limits": {"cpu": 2}},
                 "ports": [{"name": "http", "containerPort": 8080}],
                 "readinessProbe": {"httpGet": {"port": "http", "path": "/"}}}
    run = kube.ok(kube.post(Kube.wr_path(namespace), {**_pod_run("r", {"containers": [container]}),
                                                      "metadata": {"name": "r"}}))
    stored = run["spec"]["template"]["spec"]["containers"][0]
    assert stored["resources"] == {"requests": {"cpu": 0.5, "memory": "1Gi"}, "limits": {"cpu": 2}}
    assert stored["readinessProbe"]["httpGet"]["port"] == "http" and "env" not in stored
    # No defaults are added: the template is stored as written (its digest pins a started run).
    assert stored["ports"] == [{"name": "http", "containerPort": 8080}]
