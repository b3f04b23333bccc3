"""The LoraAdapter and LoraFleet CRDs, enforced by a real kube-apiserver.

Every refusal here comes from the API server (structural schema, OpenAPI patterns, CEL rules,
strict field validation); kubectl only carries the request. The expected substrings are the
schema's own messages, so a loosened or broken schema fails these tests.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet_operator import names
from node_agent.validation import ADAPTER_NAME
from tests.kube.harness import CHECKOUT, ControlPlane, KubectlError

pytestmark = pytest.mark.usefixtures("lorafleet_crds")

SHA = "0123456789abcdef" * 4

GOOD_ADAPTER: dict[str, Any] = {
    "apiVersion": "lorafleet.dev/v1alpha1",
    "kind": "LoraAdapter",
    "metadata": {"name": "good"},
    "spec": {
        "baseModel": "tiny-llama",
        "source": {"uri": "file:///var/lib/lorafleet/adapters/good", "sha256": SHA},
        "fleetRef": {"name": "default"},
    },
}


def adapter(name: str, **spec_changes: Any) -> dict[str, Any]:
    """GOOD_ADAPTER renamed, with spec keys replaced (None removes a key)."""
    obj = copy.deepcopy(GOOD_ADAPTER)
    obj["metadata"]["name"] = name
    for key, value in spec_changes.items():
        if value is None:
            obj["spec"].pop(key, None)
        else:
            obj["spec"][key] = value
    return obj


def with_source(name: str, **source: Any) -> dict[str, Any]:
    return adapter(name, source=source)


def apply_strict(cluster: ControlPlane, ns: str, obj: dict[str, Any]) -> str:
    return cluster.kubectl("apply", "--validate=strict", "-n", ns, "-f", "-", input=json.dumps(obj)).stdout


BAD_SPECS = [
    pytest.param(adapter("no-source", source=None), ["spec.source: Required value"], id="missing-source"),
    pytest.param(with_source("no-uri", sha256=SHA), ["spec.source.uri: Required value"], id="missing-uri"),
    pytest.param(adapter("no-base", baseModel=None), ["spec.baseModel: Required value"], id="missing-baseModel"),
    pytest.param(adapter("no-fleet", fleetRef=None), ["spec.fleetRef: Required value"], id="missing-fleetRef"),
    pytest.param(with_source("gs", uri="gs://bucket/adapter"), ["spec.source.uri", "should match '^(file|https?)://"], id="gs-scheme"),
    pytest.param(with_source("ftp", uri="ftp://host/adapter"), ["should match '^(file|https?)://"], id="ftp-scheme"),
    pytest.param(
        with_source("short-sha", uri="https://h/a", sha256="abc123"),
        ["spec.source.sha256", "should match '^[a-f0-9]{64}$'"],
        id="short-sha256",
    ),
    pytest.param(
        with_source("upper-sha", uri="https://h/a", sha256=SHA.upper()),
        ["spec.source.sha256", "should match '^[a-f0-9]{64}$'"],
        id="uppercase-sha256",
    ),
    pytest.param(with_source("relative", uri="file://relative/path"), ["file:// URIs must name an absolute path"], id="file-relative"),
    pytest.param(
        with_source("dotdot", uri="file:///var/lib/lorafleet/adapters/../../etc"), ["must not contain '..' path segments"], id="dotdot"
    ),
    pytest.param(
        with_source("creds", uri="https://user:pw@host/adapter"),
        ["must name a host and must not carry credentials"],
        id="https-credentials",
    ),
    pytest.param(adapter("unknown-spec", shards=3), ['unknown field "spec.shards"'], id="unknown-spec-field"),
    pytest.param(
        adapter("no-replicas", replicas=0), ["spec.replicas: Invalid value: 0", "should be greater than or equal to 1"], id="zero-replicas"
    ),
    pytest.param(
        with_source("unknown-source", uri="https://h/a", bucket="b"), ['unknown field "spec.source.bucket"'], id="unknown-source-field"
    ),
    pytest.param(adapter("pinned-string", pinned="yes"), ["spec.pinned", "boolean"], id="pinned-not-bool"),
    pytest.param(with_source("hf-norepo", uri="hf://org"), ["hf:// URIs are hf://ORG/REPO[@REVISION][/SUBDIR]"], id="hf-no-repository"),
    pytest.param(
        with_source("hf-query", uri="hf://org/repo?revision=x"), ["hf:// URIs are hf://ORG/REPO[@REVISION][/SUBDIR]"], id="hf-query"
    ),
    pytest.param(
        with_source("file-creds", uri="file:///var/lib/lorafleet/adapters/a", credentials={"secretRef": {"name": "s"}}),
        ["file:// sources take no credentials"],
        id="file-credentials",
    ),
    pytest.param(
        with_source("basic-key", uri="https://h/a", credentials={"type": "Basic", "secretRef": {"name": "s", "key": "k"}}),
        ["secretRef.key names a Bearer token"],
        id="basic-with-key",
    ),
    pytest.param(
        with_source("creds-kind", uri="https://h/a", credentials={"type": "Digest", "secretRef": {"name": "s"}}),
        ["spec.source.credentials.type", "Unsupported value"],
        id="unknown-credential-type",
    ),
]


@pytest.mark.parametrize(("obj", "messages"), BAD_SPECS)
def test_bad_adapter_spec_is_refused_with_schema_message(
    kube_cluster: ControlPlane, kube_namespace: str, obj: dict[str, Any], messages: list[str]
) -> None:
    with pytest.raises(KubectlError) as err:
        apply_strict(kube_cluster, kube_namespace, obj)
    for message in messages:
        assert message in err.value.stderr
    # Nothing was stored.
    got = kube_cluster.kubectl("get", "la", obj["metadata"]["name"], "-n", kube_namespace, "--ignore-not-found", "-o", "name")
    assert got.stdout.strip() == ""


def test_server_itself_refuses_unknown_fields_and_bad_scheme(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    """Raw POSTs, no kubectl: the API server's strict field validation and schema decide."""
    path = f"/apis/lorafleet.dev/v1alpha1/namespaces/{kube_namespace}/loraadapters"
    status, body = kube_cluster.request("POST", path + "?fieldValidation=Strict", adapter("raw-unknown", colour="blue"))
    # Strict decoding errors are 400 BadRequest; schema violations are 422 Invalid.
    assert status == 400, body
    assert 'strict decoding error: unknown field "spec.colour"' in body["message"], body

    status, body = kube_cluster.request("POST", path, with_source("raw-gs", uri="gs://b/k"))
    assert status == 422, body
    assert body["details"]["causes"][0]["field"] == "spec.source.uri"


def test_unknown_fields_are_pruned_when_not_strict(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    """A structural schema: even a non-strict client cannot store fields the schema lacks."""
    obj = adapter("pruned", colour="blue")
    kube_cluster.kubectl("create", "--validate=false", "-n", kube_namespace, "-f", "-", input=json.dumps(obj))
    stored = kube_cluster.kubectl_json("get", "la", "pruned", "-n", kube_namespace)
    assert "colour" not in stored["spec"]
    assert stored["spec"]["baseModel"] == "tiny-llama"


def test_good_adapter_is_accepted_with_defaults(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    for name, uri in (
        ("file-src", "file:///var/lib/lorafleet/adapters/a"),
        ("http-src", "http://models.internal:8080/adapters/a"),
        ("https-src", "https://example.com/a?rev=2"),
        ("s3-src", "s3://adapters/team/a"),
        ("oci-src", "oci://registry.internal:5000/team/a:v1"),
    ):
        out = apply_strict(kube_cluster, kube_namespace, with_source(name, uri=uri))
        assert "created" in out
    stored = kube_cluster.kubectl_json("get", "loraadapter", "file-src", "-n", kube_namespace)
    assert stored["spec"]["pinned"] is False  # defaulted by the schema
    assert stored["spec"]["source"] == {"uri": "file:///var/lib/lorafleet/adapters/a"}
    assert stored["metadata"]["generation"] == 1


def ready_status(**overrides: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": "Ready",
        "observedGeneration": 1,
        "agentsReady": 2,
        "agentsTarget": 2,
        "agentsSummary": "2/2",
        "ranksLoaded": 4,
        "ranksTotal": 4,
        "ranksSummary": "4/4",
        "message": "",
        "agents": [
            {"pod": "agent-0", "state": "Loaded", "ranksLoaded": 2, "ranksTotal": 2, "message": ""},
            {"pod": "agent-1", "state": "Loaded", "ranksLoaded": 2, "ranksTotal": 2, "message": ""},
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllRanksLoaded",
                "message": "every rank of 2 agents holds the adapter",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": 1,
            },
        ],
    }
    status.update(overrides)
    return status


def patch_status(cluster: ControlPlane, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    out = cluster.kubectl(
        "patch", "la", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}), "-o", "json"
    )
    return dict(json.loads(out.stdout))


def test_status_subresource_and_printer_columns(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    apply_strict(kube_cluster, kube_namespace, adapter("sql"))

    # The main resource ignores status: only the status subresource writes it.
    kube_cluster.kubectl("patch", "la", "sql", "-n", kube_namespace, "--type=merge", "-p", json.dumps({"status": {"phase": "Ready"}}))
    assert "status" not in kube_cluster.kubectl_json("get", "la", "sql", "-n", kube_namespace)

    stored = patch_status(kube_cluster, kube_namespace, "sql", ready_status())
    assert stored["status"]["phase"] == "Ready"
    assert [a["pod"] for a in stored["status"]["agents"]] == ["agent-0", "agent-1"]

    table = kube_cluster.kubectl("get", "la", "-n", kube_namespace).stdout.splitlines()
    assert re.split(r"\s{2,}", table[0].strip()) == ["NAME", "PHASE", "AGENTS", "RANKS", "BASE MODEL", "AGE"]
    assert re.split(r"\s{2,}", table[1].strip())[:5] == ["sql", "Ready", "2/2", "4/4", "tiny-llama"]

    wide = kube_cluster.kubectl("get", "loraadapters", "-o", "wide", "-n", kube_namespace).stdout.splitlines()
    assert re.split(r"\s{2,}", wide[0].strip()) == ["NAME", "PHASE", "AGENTS", "RANKS", "BASE MODEL", "FLEET", "PINNED", "MESSAGE", "AGE"]


def test_degraded_status_shows_in_columns(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    apply_strict(kube_cluster, kube_namespace, adapter("half"))
    patch_status(
        kube_cluster,
        kube_namespace,
        "half",
        ready_status(
            phase="Degraded",
            agentsReady=1,
            agentsSummary="1/2",
            ranksLoaded=2,
            ranksSummary="2/4",
            message="agent-1: rank 1: out of memory",
        ),
    )
    row = kube_cluster.kubectl("get", "la", "half", "-n", kube_namespace, "--no-headers").stdout.strip()
    assert re.split(r"\s{2,}", row)[:5] == ["half", "Degraded", "1/2", "2/4", "tiny-llama"]


@pytest.mark.parametrize(
    ("status", "message"),
    [
        pytest.param({"phase": "Running"}, 'Unsupported value: "Running"', id="unknown-phase"),
        pytest.param(ready_status(agentsSummary="3/2"), "status.agentsSummary must equal agentsReady/agentsTarget", id="agents-sum"),
        pytest.param(ready_status(ranksSummary="4/8"), "status.ranksSummary must equal ranksLoaded/ranksTotal", id="ranks-sum"),
        pytest.param(
            ready_status(
                conditions=[{"type": "Ready", "status": "Yes", "reason": "R", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
            ),
            'Unsupported value: "Yes"',
            id="condition-status",
        ),
        pytest.param(
            ready_status(conditions=[{"type": "Ready", "status": "True", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]),
            "status.conditions[0].reason: Required value",
            id="condition-reason",
        ),
        pytest.param(
            ready_status(agents=[{"pod": "a", "state": "Loaded"}, {"pod": "a", "state": "Failed"}]),
            "status.agents lists a pod more than once",
            id="duplicate-agent",
        ),
        pytest.param(
            ready_status(
                placement={
                    "placed": ["agent-0", "agent-1"],
                    "placedCount": 2,
                    "skippedCount": 2,
                    "skipped": [{"pod": "agent-2", "reason": "Full"}, {"pod": "agent-2", "reason": "Full"}],
                }
            ),
            "status.placement.skipped lists a pod more than once",
            id="duplicate-skip",
        ),
    ],
)
def test_bad_status_is_refused(kube_cluster: ControlPlane, kube_namespace: str, status: dict[str, Any], message: str) -> None:
    apply_strict(kube_cluster, kube_namespace, adapter("st"))
    with pytest.raises(KubectlError) as err:
        patch_status(kube_cluster, kube_namespace, "st", status)
    assert message in err.value.stderr


def test_short_name(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    apply_strict(kube_cluster, kube_namespace, adapter("short"))
    assert kube_cluster.kubectl("get", "la", "-n", kube_namespace, "-o", "name").stdout.split() == ["loraadapter.lorafleet.dev/short"]
    resources = kube_cluster.kubectl("api-resources", "--api-group=lorafleet.dev", "--no-headers").stdout
    assert re.search(r"^loraadapters\s+la\s+lorafleet.dev/v1alpha1\s+true\s+LoraAdapter$", resources, re.M), resources
    assert re.search(r"^lorafleets\s+lfleet\s+lorafleet.dev/v1alpha1\s+true\s+LoraFleet$", resources, re.M), resources


# ---- LoraFleet ---------------------------------------------------------------------------


def fleet(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraFleet", "metadata": {"name": name}, "spec": spec}


SELECTOR = {"matchLabels": {"app.kubernetes.io/name": "lorafleet-agent"}}


def test_fleet_defaults_and_status(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    apply_strict(
        kube_cluster,
        kube_namespace,
        fleet(
            "f", {"selector": SELECTOR, "auth": {"tokenSecretRef": {"name": "agent-token"}}, "tls": {"secretRef": {"name": "agent-tls"}}}
        ),
    )
    stored = kube_cluster.kubectl_json("get", "lorafleet", "f", "-n", kube_namespace)
    assert stored["spec"]["grpcPortName"] == "grpc"
    assert stored["spec"]["auth"]["tokenSecretRef"] == {"name": "agent-token", "key": "token"}

    status = {
        "observedGeneration": 1,
        "agents": 1,
        "readyAgents": 1,
        "members": [
            {
                "pod": "agent-0",
                "endpoint": "127.0.0.1:50051",
                "ready": True,
                "baseModel": "tiny-llama",
                "topology": {"tpSize": 2, "dpSize": 2, "attnTpSize": 1, "epSize": 1, "moeTpSize": 2},
                "capacity": {"maxLoadedLoras": 8, "maxLorasPerBatch": 4, "maxLoraRank": 16, "loadedLoras": 0},
                "backend": {"kind": "lorafleet-engine", "version": "0.1.0"},
            }
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AgentsReady",
                "message": "1/1 agents ready",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    kube_cluster.kubectl(
        "patch", "lorafleet", "f", "-n", kube_namespace, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})
    )
    row = kube_cluster.kubectl("get", "lorafleets", "-n", kube_namespace, "--no-headers").stdout.split()
    assert row[:3] == ["f", "1", "1"]
    kept = kube_cluster.kubectl_json("get", "lorafleet", "f", "-n", kube_namespace)["status"]["members"][0]
    assert kept["backend"] == {"kind": "lorafleet-engine", "version": "0.1.0"}, "the schema keeps it (not pruned)"
    twice = {**status, "members": status["members"] * 2}
    with pytest.raises(KubectlError) as err:
        kube_cluster.kubectl(
            "patch", "lorafleet", "f", "-n", kube_namespace, "--subresource=status", "--type=merge", "-p", json.dumps({"status": twice})
        )
    assert "status.members lists a pod more than once" in err.value.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param({}, "spec.selector: Required value", id="no-selector"),
        pytest.param({"selector": {}}, "selector must not be empty", id="empty-selector"),
        pytest.param(
            {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
            "values must be non-empty for In and NotIn",
            id="in-without-values",
        ),
        pytest.param({"selector": SELECTOR, "grpcPortName": "GRPC_PORT"}, "spec.grpcPortName", id="bad-port-name"),
        pytest.param(
            {"selector": SELECTOR, "auth": {"tokenSecretRef": {}}}, "spec.auth.tokenSecretRef.name: Required value", id="secret-ref-no-name"
        ),
        pytest.param(
            {"selector": SELECTOR, "auth": {"tokenSecretRef": {"name": "creds%2Ftoken"}}},
            "spec.auth.tokenSecretRef.name in body should match",
            id="token-secret-not-an-object-name",
        ),
        pytest.param(
            {"selector": SELECTOR, "tls": {"secretRef": {"name": "Agent-TLS"}}},
            "spec.tls.secretRef.name in body should match",
            id="tls-secret-not-an-object-name",
        ),
        pytest.param({"selector": SELECTOR, "port": 50051}, 'unknown field "spec.port"', id="unknown-field"),
        pytest.param({"selector": SELECTOR, "sources": {"allow": ["hf://org"]}}, "spec.sources.allow[0]", id="hf-prefix-without-slash"),
    ],
)
def test_bad_fleet_is_refused(kube_cluster: ControlPlane, kube_namespace: str, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(KubectlError) as err:
        apply_strict(kube_cluster, kube_namespace, fleet("bad", spec))
    assert message in err.value.stderr


# ---- examples ----------------------------------------------------------------------------


def test_examples_apply_strictly(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    examples = CHECKOUT.examples
    kube_cluster.kubectl("apply", "--validate=strict", "-n", kube_namespace, "-f", str(examples))
    docs = [d for f in sorted(examples.glob("*.yaml")) for d in yaml.safe_load_all(Path(f).read_text()) if d]
    fleets = [d for d in docs if d["kind"] == "LoraFleet"]
    adapters = [d for d in docs if d["kind"] == "LoraAdapter"]
    assert [f["metadata"]["name"] for f in fleets] == ["default"]
    assert fleets[0]["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "lorafleet-agent"}
    assert adapters and all(a["spec"]["fleetRef"]["name"] == "default" for a in adapters)
    names = kube_cluster.kubectl("get", "la", "-n", kube_namespace, "-o", "name").stdout.split()
    assert sorted(names) == sorted(f"loraadapter.lorafleet.dev/{a['metadata']['name']}" for a in adapters)


def test_names_the_agents_cannot_hold_are_refused(kube_cluster: ControlPlane) -> None:
    """The agents hold a LoraAdapter as "<namespace>.<name>", at most 253 characters
    (node_agent/validation.py). The CRD's CEL rule on metadata.name bounds the name for the
    longest namespace (63): the longest accepted name, in a 63-character namespace, is a
    registry name the agent's own rule accepts; one character more is refused by the API
    server with the rule's message, in any namespace."""
    bound = names.MAX_ADAPTER_NAME
    assert bound == 253 - 63 - 1
    crd = yaml.safe_load((CHECKOUT.crds / "lorafleet.dev_loraadapters.yaml").read_text())
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert rules[0]["rule"] == f"self.metadata.name.size() <= {bound}"
    longest_ns = kube_cluster.create_namespace("n" * 55 + secrets.token_hex(4))
    try:
        assert len(longest_ns) == names.MAX_NAMESPACE
        fits = "a" * bound
        assert ADAPTER_NAME.match(names.agent_name(longest_ns, fits))
        assert not ADAPTER_NAME.match(names.agent_name(longest_ns, fits + "a"))
        apply_strict(kube_cluster, longest_ns, adapter(fits))
        assert kube_cluster.kubectl_json("get", "la", fits, "-n", longest_ns)["metadata"]["name"] == fits
        # Status writes of an accepted name still pass the root rule.
        kube_cluster.kubectl(
            "patch", "la", fits, "-n", longest_ns, "--subresource=status", "--type=merge", "-p", '{"status": {"phase": "Pending"}}'
        )
        for too_long in (fits + "a", "b" * 253):
            with pytest.raises(KubectlError) as err:
                apply_strict(kube_cluster, longest_ns, adapter(too_long))
            assert "metadata.name must be at most 189 characters" in err.value.stderr
            assert kube_cluster.kubectl("get", "la", "-n", longest_ns, "-o", "name").stdout.strip() == f"loraadapter.lorafleet.dev/{fits}"
    finally:
        kube_cluster.delete_namespace(longest_ns)
