"""The diff base the operator gives kopf (``handlers.SpecDiffBase``): the same essence as kopf's
own annotation storage, built without deep-copying the status and metadata it drops (kopf
builds one at every watch event of every LoraAdapter, and the status is rewritten several times
per load). Plain data: kopf's settings as ``handlers.configure`` sets them, no cluster."""

from __future__ import annotations

import copy
import json
from typing import Any

import kopf
import pytest

from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.config import ANNOTATION_PREFIX, Settings
from lorafleet_operator.handlers import configure
from lorafleet_operator.runtime import Runtime


class Copies:
    """A status value that counts how often it is deep-copied."""

    count = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> Copies:
        Copies.count += 1
        return self


def configured() -> kopf.OperatorSettings:
    settings = Settings()
    operator_settings = kopf.OperatorSettings()
    configure(
        settings=operator_settings, memo=kopf.Memo(runtime=Runtime(settings, None, AgentClients(settings))), agent_pods={}, lora_fleets={}
    )
    return operator_settings


def adapter(**extra: Any) -> dict[str, Any]:
    last_applied = json.dumps({"spec": {"baseModel": "tiny"}})
    return {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {
            "name": "a",
            "namespace": "ns",
            "uid": "u",
            "resourceVersion": "7",
            "generation": 2,
            "finalizers": ["lorafleet.dev/unload"],
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}] * 20,
            "labels": {"team": "x"},
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": last_applied,
                f"{ANNOTATION_PREFIX}/last-handled-configuration": "{}",
                "note": "kept",
            },
        },
        "spec": {"baseModel": "tiny", "source": {"uri": "file:///a"}, "fleetRef": {"name": "f"}},
        "status": {"phase": "Ready", "agents": [{"pod": f"agent-{i}"} for i in range(64)]},
        **extra,
    }


BODIES = [
    pytest.param(adapter(), id="adapter"),
    pytest.param({k: v for k, v in adapter().items() if k != "status"}, id="no-status"),
    pytest.param({**adapter(), "metadata": {"name": "a", "namespace": "ns"}}, id="no-labels"),
    pytest.param(adapter(data={"k": "v"}), id="another-top-level-field"),
]


@pytest.mark.parametrize("raw", BODIES)
def test_the_essence_is_kopfs_own(raw: dict[str, Any]) -> None:
    ours = configured().persistence.diffbase_storage
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    body = kopf.Body(copy.deepcopy(raw))
    assert ours.build(body=body) == kopfs.build(body=body)
    for extra in (["status.phase"], [("spec",)], ["spec.source"], [("spec",), "status.phase"]):
        assert ours.build(body=body, extra_fields=extra) == kopfs.build(body=body, extra_fields=extra)


#: The extra fields kopf passes at every LoraAdapter event: the fields its handlers watch, as
#: paths (the update handler's ``field="spec"``).
HANDLER_FIELDS = {("spec",)}


@pytest.mark.parametrize("extra_fields", [None, HANDLER_FIELDS], ids=["none", "the-handlers-fields"])
def test_the_status_is_never_copied(extra_fields: Any) -> None:
    """Fails with kopf's own storage (the operator's before): it deep-copies the whole body;
    with the handlers' fields, fails with a storage that hands any extra field to kopf's path
    (kopf passes ``spec`` at every event)."""
    raw = adapter()
    raw["status"]["agents"].append(Copies())
    Copies.count = 0
    configured().persistence.diffbase_storage.build(body=kopf.Body(raw), extra_fields=extra_fields)
    assert Copies.count == 0
