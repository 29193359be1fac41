"""Writes crds/workerclasses.tether.dev.yaml (and the chart's copy): its spec.defaults take their
lease, retry, budget, review and deadline schemas from the WorkerRun CRD, so a class's defaults are
checked exactly as a run's own values. `--check`: exit 1 if the files are not what this writes
(tests/unit/crds/test_generated_crds.py runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crdgen import run_spec as sub, write  # noqa: E402

defaults = {
    "type": "object",
    "default": {},
    "description": (
        "What a run of this class takes for what it leaves out (spec.className). lease and retry "
        "are taken whole, budget and review field by field, the rest one by one; queueName and "
        "priorityClassName become the run's kueue.x-k8s.io/queue-name and priority-class labels. "
        "A run records what it took in status.class; from its first attempt on, editing the class "
        "changes nothing of it."
    ),
    "properties": {
        n: sub(n)
        for n in [
            "lease",
            "retry",
            "budget",
            "review",
            "deadlineSeconds",
            "progressDeadlineSeconds",
            "stopGraceSeconds",
            "ttlSecondsAfterFinished",
        ]
    },
}
for n, text in {
    "lease": "The lease (whole) of a run that sets none; the same rules as a run's spec.lease.",
    "retry": "The retry policy (whole) of a run that sets none; the same fields as a run's spec.retry.",
    "budget": "Each of capCents, maxTokens and budgetRef, for a run that leaves it out.",
    "review": "Each of start, startTimeoutSeconds, result and resultTimeoutSeconds, for a run that leaves it out.",
    "deadlineSeconds": "The whole-run deadline of a run that sets none (1 to 31536000 seconds).",
    "progressDeadlineSeconds": "The progress deadline of a run that sets none (1 to 31536000 seconds).",
    "stopGraceSeconds": "The stop grace of a run that sets none (0 to 3600 seconds; else 30).",
    "ttlSecondsAfterFinished": "How long a finished run of the class is kept, when it sets nothing (0 to 31536000 seconds).",
}.items():
    defaults["properties"][n]["description"] = text
defaults["properties"]["queueName"] = {
    "type": "string",
    "maxLength": 63,
    "description": "The Kueue LocalQueue (in the run's namespace) its runs are queued in, unless they are labelled kueue.x-k8s.io/queue-name.",
}
defaults["properties"]["priorityClassName"] = {
    "type": "string",
    "maxLength": 253,
    "description": "The WorkloadPriorityClass of its queued runs, unless they are labelled kueue.x-k8s.io/priority-class.",
}
# The budget's CEL transition rule (budgetRef immutable) concerns runs, not a class's defaults.
defaults["properties"]["budget"].pop("x-kubernetes-validations", None)


def bound(desc, fmt, maximum, minimum=1):
    return {
        "type": "integer",
        "format": fmt,
        "minimum": minimum,
        "maximum": maximum,
        "description": f"{desc} {minimum} to {maximum}.",
    }


bounds = {
    "type": "object",
    "default": {},
    "description": (
        "What a run of this class may not exceed, refused at apply by the admission policy "
        "tether-workerclass-bounds with a message naming the class and the bound. Each bound needs "
        "a default within it (a run that leaves the field out takes the default)."
    ),
    "properties": {
        "maxLeaseDurationSeconds": bound(
            "The longest spec.lease.durationSeconds a run may ask for (how long a silent worker keeps the run),",
            "int32",
            86400,
            5,
        ),
        "maxDeadlineSeconds": bound(
            "The longest spec.deadlineSeconds (needs defaults.deadlineSeconds, so every run of the class has a deadline),",
            "int64",
            31536000,
        ),
        "maxCapCents": bound(
            "The largest spec.budget.capCents (needs defaults.budget.capCents, so every run of the class has a cap),",
            "int64",
            1000000000000,
            0,
        ),
        "maxTokens": bound(
            "The largest spec.budget.maxTokens (needs defaults.budget.maxTokens),", "int64", 1000000000000000, 0
        ),
        "maxAttempts": bound("The most spec.retry.maxAttempts,", "int32", 100),
        "executors": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "x-kubernetes-list-type": "set",
            "items": {"type": "string", "enum": ["Pod", "External"], "description": "An executor."},
            "description": "The executors its runs may use (Pod, External). Unset: both.",
        },
        "imagePrefixes": {
            "type": "array",
            "minItems": 1,
            "maxItems": 32,
            "items": {"type": "string", "minLength": 1, "maxLength": 512, "description": "An image prefix."},
            "description": "For Pod runs: every container and init container image must start with one of these (for example registry.example.com/tools/). Unset: any image.",
        },
        "serviceAccountNames": {
            "type": "array",
            "minItems": 1,
            "maxItems": 32,
            "items": {"type": "string", "maxLength": 253, "description": "A ServiceAccount name."},
            "description": "For Pod runs: the ServiceAccounts spec.template.spec.serviceAccountName may name (a run naming none uses the namespace worker identity). Unset: any the creator may use.",
        },
        "childClasses": {
            "type": "array",
            "maxItems": 64,
            "items": {"type": "string", "maxLength": 253, "description": "A WorkerClass name."},
            "description": "The classes its runs may spawn as child runs (each child names its class in spec.className); refused at the child's creation otherwise. Unset or empty: its runs spawn no children (a run of no class spawns none either).",
        },
        "maxChildren": {
            "type": "integer", "minimum": 0, "maximum": 1000,
            "description": "The most child runs one of its runs may spawn, all its attempts together, 0 to 1000; a child past it ends Rejected (TooManyChildren) before it starts. Unset: 100.",
        },
        "maxDepth": {
            "type": "integer", "minimum": 1, "maximum": 8,
            "description": "The deepest a child of one of its runs may be in its tree (a child of a run that has no parent is at depth 1); refused at the child's creation otherwise. Unset: 8, the most any tree may be.",
        },
    },
}
rules = [
    {
        "rule": "!has(self.bounds.maxLeaseDurationSeconds) || (has(self.defaults.lease) ? self.defaults.lease.durationSeconds : 90) <= self.bounds.maxLeaseDurationSeconds",
        "message": "defaults.lease.durationSeconds (90 when defaults.lease is unset) must be within bounds.maxLeaseDurationSeconds",
        "fieldPath": ".bounds.maxLeaseDurationSeconds",
    },
    {
        "rule": "!has(self.bounds.maxDeadlineSeconds) || (has(self.defaults.deadlineSeconds) && self.defaults.deadlineSeconds <= self.bounds.maxDeadlineSeconds)",
        "message": "bounds.maxDeadlineSeconds needs defaults.deadlineSeconds within it (a run that sets none takes the default)",
        "fieldPath": ".bounds.maxDeadlineSeconds",
    },
    {
        "rule": "!has(self.bounds.maxCapCents) || (has(self.defaults.budget) && has(self.defaults.budget.capCents) && self.defaults.budget.capCents <= self.bounds.maxCapCents)",
        "message": "bounds.maxCapCents needs defaults.budget.capCents within it (a run that sets none takes the default)",
        "fieldPath": ".bounds.maxCapCents",
    },
    {
        "rule": "!has(self.bounds.maxTokens) || (has(self.defaults.budget) && has(self.defaults.budget.maxTokens) && self.defaults.budget.maxTokens <= self.bounds.maxTokens)",
        "message": "bounds.maxTokens needs defaults.budget.maxTokens within it (a run that sets none takes the default)",
        "fieldPath": ".bounds.maxTokens",
    },
    {
        "rule": "!has(self.bounds.maxAttempts) || (has(self.defaults.retry) ? self.defaults.retry.maxAttempts : 3) <= self.bounds.maxAttempts",
        "message": "defaults.retry.maxAttempts (3 when defaults.retry is unset) must be within bounds.maxAttempts",
        "fieldPath": ".bounds.maxAttempts",
    },
]
crd = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {
        "name": "workerclasses.tether.dev",
        "labels": {"app.kubernetes.io/name": "tether", "app.kubernetes.io/part-of": "tether"},
    },
    "spec": {
        "group": "tether.dev",
        "scope": "Cluster",
        "names": {
            "kind": "WorkerClass",
            "listKind": "WorkerClassList",
            "plural": "workerclasses",
            "singular": "workerclass",
            "shortNames": ["wc"],
            "categories": ["tether"],
        },
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "additionalPrinterColumns": [
                    {
                        "name": "Default",
                        "type": "string",
                        "jsonPath": ".metadata.annotations.tether\\.dev/is-default-class",
                        "description": '"true" on the class runs that name none take.',
                    },
                    {
                        "name": "Lease",
                        "type": "integer",
                        "jsonPath": ".spec.defaults.lease.durationSeconds",
                        "description": "The default lease duration (seconds).",
                    },
                    {
                        "name": "Max-Lease",
                        "type": "integer",
                        "jsonPath": ".spec.bounds.maxLeaseDurationSeconds",
                        "description": "The longest lease a run may ask for.",
                    },
                    {
                        "name": "Max-Cap",
                        "type": "integer",
                        "jsonPath": ".spec.bounds.maxCapCents",
                        "description": "The largest cap a run may ask for (cents).",
                    },
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "description": (
                            "WorkerClass is a kind of run (a short tool call, a long agent session): the defaults its runs take for "
                            "what they leave out, the bounds the API server holds them to, and the labels that name it in metrics. "
                            "Cluster-scoped, like StorageClass; a run names it in spec.className."
                        ),
                        "properties": {
                            "apiVersion": {
                                "type": "string",
                                "description": "APIVersion defines the versioned schema of this representation of an object.",
                            },
                            "kind": {
                                "type": "string",
                                "description": "Kind is a string value representing the REST resource this object represents.",
                            },
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "default": {"defaults": {}, "bounds": {}},
                                "description": "Defaults, bounds and metric labels of the class.",
                                "x-kubernetes-validations": rules,
                                "properties": {
                                    "defaults": defaults,
                                    "bounds": bounds,
                                    "labels": {
                                        "type": "object",
                                        "maxProperties": 8,
                                        "additionalProperties": {
                                            "type": "string",
                                            "maxLength": 63,
                                            "description": "A label value.",
                                        },
                                        "x-kubernetes-validations": [
                                            {
                                                "rule": "self.all(k, k.matches('^[a-z_][a-z0-9_]{0,62}$') && !(k in ['class', 'namespace', 'phase', 'reason']))",
                                                "message": "labels keys must be Prometheus label names (lowercase letters, digits, underscore) other than class, namespace, phase and reason",
                                            }
                                        ],
                                        "description": "What its runs are (tool, model, provider...): the labels of tether_workerclass_info{class=...}, which dashboards join with the per-class metrics.",
                                    },
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


write(crd, "hack/workerclass_crd.py", "spec.defaults' schemas are the run's")
