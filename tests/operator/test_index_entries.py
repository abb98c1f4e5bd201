"""handlers.index_entry / _slim_pod: what the watch-fed indexes keep of each object. managedFields and kubectl's
last-applied copy are dropped (at 10,000 nodes and 1,000 services they were most of each entry's bytes); every
field a round reads stays, and the watched body is not modified."""

from __future__ import annotations

import copy
import json
from typing import Any

from kascade_operator.handlers import _slim_pod, index_entry

LAST = "kubectl.kubernetes.io/last-applied-configuration"
MANAGED = [{"manager": "kascade", "operation": "Update", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:phase": {}, "f:targets": {}}}}]


def plan() -> dict[str, Any]:
    return {"apiVersion": "kascade.io/v1alpha1", "kind": "ScalePlan",
            "metadata": {"name": "svc-colocated-abcde", "namespace": "ns", "uid": "u1", "resourceVersion": "42",
                         "generation": 1, "creationTimestamp": "2026-12-06T00:00:00Z",
                         "labels": {"kascade.io/model-service": "svc"},
                         "annotations": {LAST: json.dumps({"spec": {"x": "y" * 500}}), "kascade.io/keep": "1"},
                         "ownerReferences": [{"kind": "ModelService", "name": "svc", "uid": "u0"}],
                         "managedFields": MANAGED},
            "spec": {"modelServiceRef": {"name": "svc"}, "targets": [{"instance": "e1", "pod": "e1"}]},
            "status": {"phase": "Succeeded"}}


def test_an_index_entry_keeps_what_rounds_read_and_drops_the_bookkeeping() -> None:
    body = plan()
    before = copy.deepcopy(body)
    e = index_entry(body)
    assert "managedFields" not in e["metadata"]
    assert e["metadata"]["annotations"] == {"kascade.io/keep": "1"}
    for k in ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp", "labels",
              "ownerReferences"):
        assert e["metadata"][k] == before["metadata"][k]
    assert (e["apiVersion"], e["kind"], e["spec"], e["status"]) == (before["apiVersion"], before["kind"],
                                                                    before["spec"], before["status"])
    assert body == before  # the watched object itself is untouched
    assert len(json.dumps(e)) < len(json.dumps(before)) / 2


def test_an_object_without_annotations_or_managed_fields_is_kept_as_it_is() -> None:
    body = {"metadata": {"name": "svc", "namespace": "ns"}, "spec": {"a": 1}}
    assert index_entry(body) == body


def test_a_pool_pod_entry_drops_the_last_applied_copy() -> None:
    pod = {"metadata": {"name": "e1", "namespace": "ns", "resourceVersion": "3", "uid": "u",
                        "labels": {"kascade.io/pool": "warm"}, "managedFields": MANAGED,
                        "annotations": {LAST: "{...}", "kascade.io/endpoint": "127.0.0.1:1"}},
           "spec": {"nodeName": "n1", "containers": [{"name": "e"}]}, "status": {"phase": "Running"}}
    slim = _slim_pod(pod)
    assert slim["metadata"]["annotations"] == {"kascade.io/endpoint": "127.0.0.1:1"}
    assert "managedFields" not in slim["metadata"] and slim["metadata"]["resourceVersion"] == "3"
