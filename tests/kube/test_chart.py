"""The Helm chart: lint, refusals, render, server-side dry run, and the operator's RBAC.

Everything goes through the real helm binary (scripts/build-kube.sh). The chart's RBAC is
checked against the real authorizer (``kubectl auth can-i`` impersonating the operator's
ServiceAccount), both for what it must allow and for what it must not. The chart's own
programs (files/*.py: the model download, the uninstall cleanup) run here for real, against a
loopback HTTP server and the test control plane.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import io
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from tests.kube.harness import CHECKOUT, ControlPlane

CHART = CHECKOUT.chart


#: The default install refuses without a model source; most renders name a PVC.
MODEL = "agent.model.pvc.claimName=models"


@pytest.mark.parametrize("values", ["", *sorted(p.name for p in (CHART / "ci").glob("*.yaml"))])
def test_helm_lint_strict(kube_cluster: ControlPlane, values: str) -> None:
    """Clean with the defaults too: helm lint runs the templates' `fail` refusals (the missing
    model source) as INFO lines, which `helm install/template` turn into errors."""
    extra = ["-f", str(CHART / "ci" / values)] if values else []
    out = kube_cluster.helm("lint", "--strict", str(CHART), *extra)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def render(cluster: ControlPlane, namespace: str, *sets: str) -> str:
    args = ["template", "lf", str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    return cluster.helm(*args).stdout


def render_docs(cluster: ControlPlane, *sets: str) -> dict[tuple[str, str], Any]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(render(cluster, "lf-ns", *sets)) if d}


def kinds(manifest: str) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(manifest) if d]


SHA = "0123456789abcdef" * 4

VARIANTS = [
    pytest.param((MODEL,), id="defaults"),
    pytest.param(
        (
            "auth.existingSecret=agent-token",
            "tls.enabled=true",
            "tls.secretName=agent-tls",
            "agent.gpus=0",
            "agent.device=cpu",
            "agent.tpSize=2",
            "agent.dpSize=2",
            "operator.replicas=2",
            "image.tag=dev",
            "agent.model.hostPath.path=/srv/models",
        ),
        id="auth-tls-cpu",
    ),
    pytest.param(("agent.enabled=false", "fleet.create=false", "serviceAccount.name=op"), id="operator-only"),
    pytest.param(
        (
            "networkPolicy.enabled=true",
            "agent.model.download.url=https://m.example/m.tgz",
            f"agent.model.download.sha256={SHA}",
            "auth.enabled=false",
        ),
        id="download-netpol",
    ),
]


@pytest.mark.parametrize("sets", VARIANTS)
def test_helm_template_applies_with_server_dry_run(kube_cluster: ControlPlane, kube_namespace: str, sets: tuple[str, ...]) -> None:
    # The chart's own CRDs first, for real (helm installs crds/ before the templates).
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev"
    )
    manifest = render(kube_cluster, kube_namespace, *sets)
    objects = kinds(manifest)
    assert ("Role", "lf-lorafleet-operator") in objects
    out = kube_cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", kube_namespace, "-f", "-", input=manifest).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == len(objects), out
    assert all(ln.endswith("(server dry run)") for ln in lines), out
    # A dry run stores nothing.
    assert kube_cluster.kubectl("get", "roles", "-n", kube_namespace, "-o", "name").stdout == ""


def test_rendered_workloads(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, "agent.gpus=2", "agent.tpSize=2")
    sts: dict[str, Any] = docs[("StatefulSet", "lf-lorafleet-agent")]
    pod = sts["spec"]["template"]
    agent = pod["spec"]["containers"][0]
    assert agent["command"] == ["lorafleet-agent", "serve"]
    assert agent["image"] == "ghcr.io/lorafleet/lorafleet-agent:0.1.0"
    assert agent["ports"] == [
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
        {"name": "health", "containerPort": 8081, "protocol": "TCP"},
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert agent[probe]["grpc"] == {"port": 8081}
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert agent["resources"]["requests"]["nvidia.com/gpu"] == 2

    fleet = docs[("LoraFleet", "default")]
    selector = fleet["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/name"] == "lorafleet-agent"
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert fleet["spec"]["routing"] == {"serviceName": "lf-lorafleet-adapters"}  # selector-less

    op = docs[("Deployment", "lf-lorafleet-operator")]["spec"]["template"]["spec"]
    assert op["serviceAccountName"] == "lf-lorafleet-operator"
    assert op["containers"][0]["command"] == ["lorafleet-operator"]
    assert op["containers"][0]["image"] == "ghcr.io/lorafleet/lorafleet-operator:0.1.0"


def test_values_are_all_documented() -> None:
    """Every key of values.yaml has a comment right above it or above one of its parents."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    # Stack of (indent, documented) for the mapping keys enclosing the current line.
    parents: list[tuple[int, bool]] = []
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "- ")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while parents and parents[-1][0] >= indent:
            parents.pop()
        commented = i > 0 and lines[i - 1].strip().startswith("#")
        documented = commented or any(doc for _, doc in parents)
        if not documented and stripped.partition(":")[2].strip():
            undocumented.append(stripped.partition(":")[0])
        parents.append((indent, documented))
    assert undocumented == []


# ---- RBAC, checked by the real authorizer ------------------------------------------------

ALLOWED = [
    ("get", "loraadapters.lorafleet.dev"),
    ("list", "loraadapters.lorafleet.dev"),
    ("watch", "loraadapters.lorafleet.dev"),
    ("patch", "loraadapters.lorafleet.dev"),
    ("update", "loraadapters.lorafleet.dev"),
    ("patch", "loraadapters.lorafleet.dev#status"),
    ("update", "loraadapters.lorafleet.dev#status"),
    ("list", "lorafleets.lorafleet.dev"),
    ("watch", "lorafleets.lorafleet.dev"),
    ("patch", "lorafleets.lorafleet.dev#status"),
    ("list", "pods"),
    ("watch", "pods"),
    ("get", "pods"),
    ("get", "secrets/lf-lorafleet-agent-token"),
    ("create", "events"),
    ("create", "events.events.k8s.io"),
    ("create", "leases.coordination.k8s.io"),
    ("update", "leases.coordination.k8s.io/lorafleet-operator"),
    ("list", "endpointslices.discovery.k8s.io"),
    ("watch", "endpointslices.discovery.k8s.io"),
    ("create", "endpointslices.discovery.k8s.io"),
    ("update", "endpointslices.discovery.k8s.io"),
    ("delete", "endpointslices.discovery.k8s.io"),
]

DENIED = [
    ("create", "loraadapters.lorafleet.dev"),
    ("delete", "loraadapters.lorafleet.dev"),
    ("delete", "lorafleets.lorafleet.dev"),
    ("create", "pods"),
    ("delete", "pods"),
    ("patch", "pods"),
    ("patch", "pods#status"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("create", "secrets"),
    ("get", "secrets/db-password"),  # only the Secrets the chart names (resourceNames)
    ("update", "leases.coordination.k8s.io/someone-elses-lease"),
    ("delete", "events"),
    ("list", "configmaps"),
    ("create", "deployments.apps"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
]


def can_i(cluster: ControlPlane, user: str, verb: str, resource: str, ns: str) -> bool:
    """Ask the API server's authorizer; ``resource`` is "res[/name][#subresource]"."""
    resource, _, sub = resource.partition("#")
    extra = [f"--subresource={sub}"] if sub else []
    proc = cluster.kubectl("auth", "can-i", verb, resource, *extra, "-n", ns, "--as", user, check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stderr
    return proc.stdout.strip() == "yes"


def test_operator_rbac_is_enough_and_no_broader(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]) -> None:
    manifest = render(kube_cluster, kube_namespace, "agent.enabled=false", "operator.enabled=false", "fleet.create=false")
    kube_cluster.kubectl("apply", "--validate=strict", "-n", kube_namespace, "-f", "-", input=manifest)
    sa = f"system:serviceaccount:{kube_namespace}:lf-lorafleet-operator"
    wrong_allowed = [(v, r) for v, r in DENIED if can_i(kube_cluster, sa, v, r, kube_namespace)]
    wrong_denied = [(v, r) for v, r in ALLOWED if not can_i(kube_cluster, sa, v, r, kube_namespace)]
    assert (wrong_denied, wrong_allowed) == ([], [])

    # Cluster-wide only what finishing a terminating namespace needs (its own resources, reading
    # pods, EndpointSlices and namespaces): no Secrets, Events or writes of anything else
    # outside its namespace.
    other = kube_cluster.create_namespace(prefix="other")
    try:
        for verb, resource in (
            ("get", "secrets/lf-lorafleet-agent-token"),
            ("create", "events"),
            ("create", "pods"),
            ("delete", "loraadapters.lorafleet.dev"),
            ("create", "endpointslices.discovery.k8s.io"),
        ):
            assert not can_i(kube_cluster, sa, verb, resource, other), (verb, resource)
        for verb, resource in (("list", "pods"), ("watch", "endpointslices.discovery.k8s.io"), ("patch", "loraadapters.lorafleet.dev")):
            assert can_i(kube_cluster, sa, verb, resource, other), (verb, resource)
    finally:
        kube_cluster.delete_namespace(other)
    cluster_roles = kube_cluster.kubectl("get", "clusterroles", "-l", "app.kubernetes.io/instance=lf", "-o", "name").stdout
    assert cluster_roles.split() == [f"clusterrole.rbac.authorization.k8s.io/lf-lorafleet-operator-{kube_namespace}"]
    kube_cluster.kubectl("delete", "clusterrole,clusterrolebinding", f"lf-lorafleet-operator-{kube_namespace}")


def test_watch_namespaces_get_their_own_roles(kube_cluster: ControlPlane) -> None:
    manifest = render(kube_cluster, "lf-system", MODEL, "operator.watchNamespaces={team-a,team-b}")
    roles = [
        (d["kind"], d["metadata"]["namespace"], d["metadata"]["name"])
        for d in yaml.safe_load_all(manifest)
        if d and d["kind"] in ("Role", "RoleBinding")
    ]
    assert ("Role", "team-a", "lf-lorafleet-operator") in roles
    assert ("RoleBinding", "team-b", "lf-lorafleet-operator") in roles
    assert ("Role", "lf-system", "lf-lorafleet-operator-leader-election") in roles
    assert ("Role", "lf-system", "lf-lorafleet-operator") not in roles
    deploy = next(d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LORAFLEET_WATCH_NAMESPACES"] == "team-a,team-b"


@pytest.mark.parametrize("sets", VARIANTS[:2])
def test_agent_args_parse_with_the_agents_own_parser(kube_cluster: ControlPlane, sets: tuple[str, ...]) -> None:
    """The StatefulSet's command line is one `lorafleet-agent serve` accepts, meaning what the
    values say (the chart follows node_agent/cli/, not guesses)."""
    from node_agent.cli import build_parser

    docs = render_docs(kube_cluster, *sets)
    agent = docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["spec"]
    container = agent["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert args.listen == "0.0.0.0:50051"
    assert args.metrics_port == 9090
    assert args.http_listen == "0.0.0.0:8000"  # the OpenAI-compatible API is on by default
    assert args.base_model_name == "tiny-llama"
    assert str(args.model) == "/models/base"
    assert [str(r) for r in args.adapter_root] == ["/var/lib/lorafleet/adapters"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {str(args.model), str(args.adapter_root[0]), str(args.cache_dir)} <= mounts
    if "agent.tpSize=2" in sets:
        assert (args.tp, args.dp, args.device) == (2, 2, "cpu")
        assert str(args.auth_token_file) == "/var/run/lorafleet/auth/token"
        assert (str(args.tls_cert), str(args.tls_key), str(args.tls_client_ca)) == (
            "/var/run/lorafleet/tls/tls.crt",
            "/var/run/lorafleet/tls/tls.key",
            "/var/run/lorafleet/tls/ca.crt",
        )
    else:
        assert (args.tp, args.dp, args.ep, args.device, args.max_lora_rank) == (1, 1, 1, "cuda", 16)
        # Auth is on by default, TLS off.
        assert str(args.auth_token_file) == "/var/run/lorafleet/auth/token"
        assert args.tls_cert is None
        # No http(s) source is allowed until the values name some.
        assert (args.allow_source, args.allow_source_network) == ([], [])


def test_agent_source_allowlist_values_become_the_agents_flags(kube_cluster: ControlPlane) -> None:
    from node_agent.cli import build_parser

    docs = render_docs(
        kube_cluster,
        MODEL,
        "agent.sources.allow={https://huggingface.co/,https://m.example:8443/lora/}",
        "agent.sources.allowNetworks={10.0.0.0/8}",
    )
    container = docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert args.allow_source == ["https://huggingface.co/", "https://m.example:8443/lora/"]
    assert args.allow_source_network == ["10.0.0.0/8"]
    # The chart's fleet allows the same prefixes, so the operator admits what the agents fetch.
    fleet = docs[("LoraFleet", "default")]["spec"]
    assert fleet["sources"] == {"allow": ["https://huggingface.co/", "https://m.example:8443/lora/"]}
    assert "pinning" not in fleet
    assert "sources" not in render_docs(kube_cluster, MODEL)[("LoraFleet", "default")]["spec"]
    pinning = render_docs(kube_cluster, MODEL, "fleet.allowPinning=true")[("LoraFleet", "default")]["spec"]["pinning"]
    assert pinning == {"allowed": True}


def test_hub_repositories_and_endpoint_are_the_fleet_owners(kube_cluster: ControlPlane) -> None:
    """hf:// repositories go to the chart's LoraFleet (the operator's check) beside the http(s)
    prefixes, never to the agents' --allow-source (http(s) only); the hub endpoint (a mirror
    here) goes to the agents' --hub-endpoint."""
    from node_agent.cli import build_parser

    docs = render_docs(
        kube_cluster,
        MODEL,
        "agent.sources.allow={https://hub.example/mirror/}",
        "agent.sources.allowHub={hf://acme/,hf://other/sql-lora}",
        "agent.sources.hubEndpoint=https://hub.example/mirror",
    )
    container = docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert args.hub_endpoint == "https://hub.example/mirror"
    assert args.allow_source == ["https://hub.example/mirror/"]
    fleet = docs[("LoraFleet", "default")]["spec"]
    assert fleet["sources"] == {"allow": ["https://hub.example/mirror/", "hf://acme/", "hf://other/sql-lora"]}
    # The default endpoint is the Hub's.
    default = agent_pod(render_docs(kube_cluster, MODEL))["containers"][0]
    assert build_parser().parse_args(default["command"][1:] + default["args"]).hub_endpoint == "https://huggingface.co"


def test_agents_know_their_own_pod(kube_cluster: ControlPlane) -> None:
    """--pod-name is the pod's NAMESPACE/NAME from the downward API (Kubernetes expands the
    $(VAR) references from the container's env), so an agent answers identity challenges for
    its own pod only (tests/kube/test_real_node.py asks a real agent pod)."""
    from node_agent.cli import build_parser

    container = agent_pod(render_docs(kube_cluster, MODEL))["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert args.pod_name == "$(POD_NAMESPACE)/$(POD_NAME)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


# ---- refusals: values.schema.json and templates/_validate.tpl --------------------------------

REFUSALS = [
    # JSON Schema: types, ranges, known names.
    (("agent.replicas=-3",), "at '/agent/replicas': minimum: got -3, want 1"),
    (("agent.replicas=0",), "at '/agent/replicas': minimum: got 0, want 1"),
    (("operator.replicas=0",), "at '/operator/replicas': minimum: got 0, want 1"),
    (("agent.device=tpu",), "at '/agent/device': value must be one of 'cuda', 'cpu'"),
    (("agent.sources.allow={http://user:pw@m.example/}",), "at '/agent/sources/allow/0'"),
    (("agent.sources.allow={m.example}",), "at '/agent/sources/allow/0'"),
    (("agent.grpcPort=70000",), "at '/agent/grpcPort': maximum: got 70,000, want 65,535"),
    (("agent.metricsPort=0",), "at '/agent/metricsPort': minimum: got 0, want 1"),
    (("operator.metricsPort=65536",), "at '/operator/metricsPort': maximum: got 65,536, want 65,535"),
    (("agent.tpSize=0",), "at '/agent/tpSize': minimum: got 0, want 1"),
    (("agent.tpSize=two",), "at '/agent/tpSize': got string, want integer"),
    (("agent.gpus=-1",), "at '/agent/gpus': minimum: got -1, want 0"),
    (("agent.tpyo=1",), "at '/agent': additional properties 'tpyo' not allowed"),
    (("operator.logLevel=LOUD",), "at '/operator/logLevel': value must be one of"),
    (("agent.model.download.url=ftp://m.example/m.tgz",), "at '/agent/model/download/url'"),
    (("agent.model.download.url=https://m.example/m.tgz", "agent.model.download.sha256=ABC"), "at '/agent/model/download/sha256'"),
    # Cross-field rules (fail in a template helper).
    (("agent.tpSize=3", "agent.gpus=3", "agent.dpSize=2"), "agent.tpSize (3) must be divisible by agent.dpSize (2)"),
    (("agent.tpSize=4", "agent.gpus=4", "agent.epSize=3"), "agent.tpSize (4) must be divisible by agent.epSize (3)"),
    (("agent.tpSize=2",), "agent.gpus (1) must equal agent.tpSize (2) with agent.device=cuda"),
    (("agent.gpus=0",), "agent.gpus (0) must equal agent.tpSize (1) with agent.device=cuda"),
    (("agent.device=cpu",), "agent.gpus (1) must be 0 with agent.device=cpu"),
    (("agent.metricsPort=50051",), "agent.grpcPort and agent.metricsPort must differ (both 50051)"),
    (("agent.http.port=9090",), "agent.http.port (9090) must differ from agent.grpcPort and agent.metricsPort"),
    (("agent.http.port=0",), "at '/agent/http/port': minimum: got 0, want 1"),
    (("agent.sources.allow={https://huggingface.co}",), "at '/agent/sources/allow/0': 'https://huggingface.co' does not match pattern"),
    (("agent.healthPort=8000",), "agent.healthPort (8000) must differ from agent.grpcPort, agent.metricsPort and agent.http.port"),
    (("agent.healthPort=70000",), "at '/agent/healthPort': maximum: got 70,000, want 65,535"),
    (
        ("agent.model.hostPath.path=/srv/models",),
        "the agents' model has more than one source (agent.model.pvc.claimName, agent.model.hostPath.path)",
    ),
    (("agent.model.pvc.subPath=../up",), "agent.model.pvc.subPath (../up) must be a relative path"),
    (("tls.enabled=true",), "tls.enabled=true needs tls.secretName"),
    (("agent.sources.allowHub={hf://acme}",), "at '/agent/sources/allowHub/0': 'hf://acme' does not match pattern"),
    (("agent.sources.allowHub={https://huggingface.co/acme/}",), "at '/agent/sources/allowHub/0'"),
    (("agent.sources.hubEndpoint=ftp://hub.example",), "at '/agent/sources/hubEndpoint'"),
    (
        ("agent.sources.allowHub={hf://acme/}",),
        "agent.sources.allowHub has hf://acme/, but no agent.sources.allow prefix covers its URLs at "
        "agent.sources.hubEndpoint (https://huggingface.co/acme/): add one such as https://huggingface.co/",
    ),
    (
        ("agent.sources.allowHub={hf://acme/lora}", "agent.sources.allow={https://huggingface.co/other/}"),
        "agent.sources.allowHub has hf://acme/lora, but no agent.sources.allow prefix covers",
    ),
]

DOWNLOAD_REFUSALS = [
    (("agent.model.download.url=https://m.example/m.tgz",), "agent.model.download.sha256 is required with agent.model.download.url"),
    (
        ("agent.model.download.url=http://m.example/m.tgz", f"agent.model.download.sha256={SHA}"),
        "agent.model.download.url is plaintext http://: use https://, or set agent.model.download.allowHttp=true",
    ),
    (
        ("agent.model.download.url=https://user:pw@m.example/m.tgz", f"agent.model.download.sha256={SHA}"),
        "without credentials, query or fragment",
    ),
    (
        ("agent.model.download.url=https://m.example/m.tgz?sig=x", f"agent.model.download.sha256={SHA}"),
        "without credentials, query or fragment",
    ),
]


def refusal(cluster: ControlPlane, *sets: str) -> str:
    args = ["template", "lf", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = cluster.helm(*args, check=False)
    assert proc.returncode != 0, f"helm rendered {sets}"
    return proc.stderr


@pytest.mark.parametrize(("sets", "message"), REFUSALS, ids=[",".join(s) for s, _ in REFUSALS])
def test_inconsistent_values_are_refused(kube_cluster: ControlPlane, sets: tuple[str, ...], message: str) -> None:
    assert message in refusal(kube_cluster, MODEL, *sets)


@pytest.mark.parametrize(("sets", "message"), DOWNLOAD_REFUSALS, ids=[",".join(s) for s, _ in DOWNLOAD_REFUSALS])
def test_bad_model_downloads_are_refused(kube_cluster: ControlPlane, sets: tuple[str, ...], message: str) -> None:
    assert message in refusal(kube_cluster, *sets)


def test_the_default_install_refuses_without_a_model_source(kube_cluster: ControlPlane) -> None:
    err = refusal(kube_cluster)
    for value in (
        "agent.model.pvc.claimName",
        "agent.model.hostPath.path",
        "agent.model.download.url",
        "agent.model.download.sha256",
        "docs/deploy.md",
    ):
        assert value in err
    # Without agents there is no model to provision.
    render(kube_cluster, "lf-ns", "agent.enabled=false")


# ---- the agents' pod: security, probes, auth, metrics, disruption, network ------------------


def agent_pod(docs: dict[tuple[str, str], Any]) -> dict[str, Any]:
    spec: dict[str, Any] = docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["spec"]
    return spec


def all_pod_specs(docs: dict[tuple[str, str], Any]) -> dict[str, dict[str, Any]]:
    specs = {}
    for (kind, name), d in docs.items():
        if kind == "Pod":
            specs[name] = d["spec"]
        elif kind in ("StatefulSet", "Deployment", "Job"):
            specs[name] = d["spec"]["template"]["spec"]
    return specs


def test_every_pod_runs_non_root_read_only_without_privileges(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, "agent.model.download.url=https://m.example/m.tgz", f"agent.model.download.sha256={SHA}")
    specs = all_pod_specs(docs)
    assert set(specs) == {"lf-lorafleet-agent", "lf-lorafleet-operator", "lf-lorafleet-uninstall", "lf-lorafleet-test-agents"}
    for name, spec in specs.items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == 65532, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, (name, c["name"])
    pod = agent_pod(docs)
    assert pod["automountServiceAccountToken"] is False
    agent = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    # Where the agent writes: emptyDirs, each with a size limit; the rest is read-only.
    for path, name in (("/tmp", "tmp"), ("/var/cache/lorafleet", "cache"), ("/dev/shm", "dshm")):
        assert mounts[path]["name"] == name and not mounts[path].get("readOnly")
        assert "sizeLimit" in volumes[name]["emptyDir"]
    for path in ("/models/base", "/var/lib/lorafleet/adapters", "/var/run/lorafleet/auth"):
        assert mounts[path]["readOnly"] is True, path
    # Plain values (POD_NAME and POD_NAMESPACE come from the downward API instead).
    env = {e["name"]: e["value"] for e in agent["env"] if "value" in e}
    assert env["HOME"] == "/tmp" and env["TRITON_CACHE_DIR"].startswith("/tmp/")


def test_startup_probe_allows_the_engines_start_up_budget(kube_cluster: ControlPlane) -> None:
    for budget in (300, 120, 900):
        agent = agent_pod(render_docs(kube_cluster, MODEL, f"agent.startupTimeoutSeconds={budget}"))["containers"][0]
        probe = agent["startupProbe"]
        assert probe["grpc"] == {"port": 8081}
        allowed = probe["periodSeconds"] * probe["failureThreshold"]
        assert budget + 60 <= allowed < budget + 70, (budget, allowed)
        assert agent["livenessProbe"]["grpc"] == agent["readinessProbe"]["grpc"] == {"port": 8081}
        # The engine gets the same budget, so its own timeout (with its message) comes first.
        assert f"--engine-startup-timeout-s={budget}" in agent["args"]
    # kubelet's gRPC probes send no token and speak no TLS: under TLS they still ask the agent's
    # health, on its plaintext health-only listener.
    tls = agent_pod(render_docs(kube_cluster, MODEL, "tls.enabled=true", "tls.secretName=t"))["containers"][0]
    assert "--health-listen=0.0.0.0:8081" in tls["args"] and "--tls-cert=/var/run/lorafleet/tls/tls.crt" in tls["args"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert tls[probe]["grpc"] == {"port": 8081} and "tcpSocket" not in tls[probe]


def test_auth_is_on_by_default_with_a_generated_secret(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL)
    secret = docs[("Secret", "lf-lorafleet-agent-token")]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert render_docs(kube_cluster, MODEL)[("Secret", "lf-lorafleet-agent-token")]["data"] != secret["data"]
    pod = agent_pod(docs)
    vol = next(v for v in pod["volumes"] if v["name"] == "auth")
    assert vol["secret"]["secretName"] == "lf-lorafleet-agent-token"
    assert vol["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert "--auth-token-file=/var/run/lorafleet/auth/token" in pod["containers"][0]["args"]
    fleet = docs[("LoraFleet", "default")]["spec"]
    assert fleet["auth"] == {"tokenSecretRef": {"name": "lf-lorafleet-agent-token", "key": "token"}}
    assert "tls" not in fleet

    docs = render_docs(
        kube_cluster,
        MODEL,
        "auth.existingSecret=mine",
        "auth.secretKey=bearer",
        "tls.enabled=true",
        "tls.secretName=agent-tls",
        "tls.serverName=agents.lf",
    )
    assert not [k for k in docs if k[0] == "Secret"]
    fleet = docs[("LoraFleet", "default")]["spec"]
    assert fleet["auth"] == {"tokenSecretRef": {"name": "mine", "key": "bearer"}}
    assert fleet["tls"] == {"secretRef": {"name": "agent-tls"}, "serverName": "agents.lf"}
    pod = agent_pod(docs)
    vol = next(v for v in pod["volumes"] if v["name"] == "auth")
    assert (vol["secret"]["secretName"], vol["secret"]["items"]) == ("mine", [{"key": "bearer", "path": "token"}])

    docs = render_docs(kube_cluster, MODEL, "auth.enabled=false")
    assert not [k for k in docs if k[0] == "Secret"]
    assert "auth" not in docs[("LoraFleet", "default")]["spec"]
    assert not [a for a in agent_pod(docs)["containers"][0]["args"] if "auth" in a]


def test_auth_token_is_kept_across_upgrades(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]) -> None:
    """A real install and upgrade (no workloads): `lookup` keeps the generated token."""
    ns = kube_namespace
    light = ["--set", "agent.enabled=false", "--set", "operator.enabled=false"]

    def token() -> str:
        data = kube_cluster.kubectl_json("get", "secret", "lf-lorafleet-agent-token", "-n", ns)["data"]
        return str(data["token"])

    kube_cluster.helm("install", "lf", str(CHART), "-n", ns, *light)
    try:
        first = token()
        kube_cluster.helm("upgrade", "lf", str(CHART), "-n", ns, *light, "--set", "fleet.name=other")
        assert token() == first
        fleet = kube_cluster.kubectl_json("get", "lorafleet", "other", "-n", ns)["spec"]
        assert fleet["auth"]["tokenSecretRef"]["name"] == "lf-lorafleet-agent-token"
    finally:
        kube_cluster.helm("uninstall", "lf", "-n", ns, "--no-hooks")


def test_metrics_port_is_served_and_exposed(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, "agent.metricsPort=9400")
    agent = agent_pod(docs)["containers"][0]
    assert "--metrics-port=9400" in agent["args"]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in agent["ports"]
    svc = docs[("Service", "lf-lorafleet-agent")]["spec"]["ports"]
    assert {"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"} in svc
    assert not [k for k in docs if k[0] == "ServiceMonitor"]
    sm = render_docs(kube_cluster, MODEL, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")[
        ("ServiceMonitor", "lf-lorafleet-agent")
    ]
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"] == docs[("Service", "lf-lorafleet-agent")]["spec"]["selector"]


def test_http_api_port_is_served_and_exposed(kube_cluster: ControlPlane) -> None:
    """agent.http: the agents' --http-listen, their container port "http" and the Service's."""
    from node_agent.cli import build_parser

    docs = render_docs(kube_cluster, MODEL, "agent.http.port=8080")
    agent = agent_pod(docs)["containers"][0]
    assert build_parser().parse_args(agent["command"][1:] + agent["args"]).http_listen == "0.0.0.0:8080"
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in agent["ports"]
    svc = docs[("Service", "lf-lorafleet-agent")]["spec"]["ports"]
    assert {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"} in svc
    docs = render_docs(kube_cluster, MODEL, "agent.http.enabled=false", "networkPolicy.enabled=true")
    agent = agent_pod(docs)["containers"][0]
    assert not [a for a in agent["args"] if a.startswith("--http-listen")]
    assert "http" not in {p["name"] for p in agent["ports"]}
    assert "http" not in {p["name"] for p in docs[("Service", "lf-lorafleet-agent")]["spec"]["ports"]}
    assert "http" not in {p["port"] for p in docs[("NetworkPolicy", "lf-lorafleet-agent")]["spec"]["ingress"][0]["ports"]}


def test_agent_client_service_balances_the_ready_agents(kube_cluster: ControlPlane) -> None:
    """agent.service: a ClusterIP (or NodePort) Service in front of the agents for clients'
    gRPC and HTTP calls; only Ready agents (no publishNotReadyAddresses), no metrics port, and
    labels the ServiceMonitor does not select."""
    docs = render_docs(kube_cluster, MODEL)
    svc = docs[("Service", "lf-lorafleet-agent-api")]
    pod_labels = agent_pod_labels(docs)
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert "publishNotReadyAddresses" not in svc["spec"] and "clusterIP" not in svc["spec"]
    assert svc["spec"]["ports"] == [
        {"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP"},
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
    ]
    headless = docs[("Service", "lf-lorafleet-agent")]
    assert not headless["spec"]["selector"].items() <= svc["metadata"]["labels"].items()
    node_port = render_docs(
        kube_cluster, MODEL, "agent.service.type=NodePort", "agent.service.grpcNodePort=30051", "agent.http.enabled=false"
    )[("Service", "lf-lorafleet-agent-api")]["spec"]
    assert node_port["type"] == "NodePort"
    assert node_port["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP", "nodePort": 30051}]
    assert ("Service", "lf-lorafleet-agent-api") not in render_docs(kube_cluster, MODEL, "agent.service.enabled=false")
    assert "agent.service.type" in refusal(kube_cluster, MODEL, "agent.service.type=LoadBalancer").replace("/", ".")


def test_adapter_endpointslices_have_a_service_of_their_own(kube_cluster: ControlPlane) -> None:
    """The LoraFleet's spec.routing.serviceName is a headless Service without a selector, with
    the slices' port names (grpc, http): the endpointslice controller leaves it alone, and the
    agents' own headless Service (which has a selector) is not the one the adapter slices name,
    so its DNS name does not list their endpoints again. Not selected by the ServiceMonitor."""
    docs = render_docs(kube_cluster, MODEL)
    service_name = docs[("LoraFleet", "default")]["spec"]["routing"]["serviceName"]
    assert service_name == "lf-lorafleet-adapters"
    svc = docs[("Service", service_name)]
    assert svc["spec"] == {
        "clusterIP": "None",
        "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP"}, {"name": "http", "port": 8000, "protocol": "TCP"}],
    }
    agents = docs[("Service", "lf-lorafleet-agent")]
    assert "selector" in agents["spec"] and service_name != "lf-lorafleet-agent"
    assert not agents["spec"]["selector"].items() <= svc["metadata"]["labels"].items()
    no_http = render_docs(kube_cluster, MODEL, "agent.http.enabled=false", "agent.grpcPort=50099")
    assert no_http[("Service", service_name)]["spec"]["ports"] == [{"name": "grpc", "port": 50099, "protocol": "TCP"}]
    # No fleet of the chart's: no Service for its slices either.
    assert ("Service", service_name) not in render_docs(kube_cluster, MODEL, "fleet.create=false")


def agent_pod_labels(docs: dict[tuple[str, str], Any]) -> dict[str, str]:
    return dict(docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["metadata"]["labels"])


def test_pod_disruption_budget(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL)
    pdb = docs[("PodDisruptionBudget", "lf-lorafleet-agent")]["spec"]
    labels = docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["metadata"]["labels"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert ("PodDisruptionBudget", "lf-lorafleet-agent") not in render_docs(kube_cluster, MODEL, "agent.podDisruptionBudget.enabled=false")


def test_network_policy_admits_the_operator_and_labelled_clients(kube_cluster: ControlPlane) -> None:
    assert not [k for k in render_docs(kube_cluster, MODEL) if k[0] == "NetworkPolicy"]
    docs = render_docs(kube_cluster, MODEL, "networkPolicy.enabled=true")
    np = docs[("NetworkPolicy", "lf-lorafleet-agent")]["spec"]
    agent_labels = docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["metadata"]["labels"]
    operator_labels = docs[("Deployment", "lf-lorafleet-operator")]["spec"]["template"]["metadata"]["labels"]
    assert np["podSelector"]["matchLabels"].items() <= agent_labels.items()
    assert np["policyTypes"] == ["Ingress"]
    (rule,) = np["ingress"]
    assert {p["port"] for p in rule["ports"]} == {"grpc", "metrics", "http"}
    peers = [p["podSelector"]["matchLabels"] for p in rule["from"]]
    assert peers[0].items() <= operator_labels.items()
    assert peers[1] == {"lorafleet.dev/client": "true"}
    # The helm test pod is such a client.
    test_pod = docs[("Pod", "lf-lorafleet-test-agents")]
    assert test_pod["metadata"]["labels"]["lorafleet.dev/client"] == "true"
    np = render_docs(
        kube_cluster,
        MODEL,
        "networkPolicy.enabled=true",
        "networkPolicy.clientNamespaceSelector.matchLabels.team=a",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
    )[("NetworkPolicy", "lf-lorafleet-agent")]["spec"]
    assert np["ingress"][0]["from"][1]["namespaceSelector"] == {"matchLabels": {"team": "a"}}
    assert np["ingress"][1]["ports"] == [{"port": "metrics", "protocol": "TCP"}]


# ---- the model: PVC, hostPath, download ---------------------------------------------------


def test_model_from_a_pvc_subpath(kube_cluster: ControlPlane) -> None:
    pod = agent_pod(render_docs(kube_cluster, MODEL, "agent.model.pvc.subPath=llama/v1"))
    vol = next(v for v in pod["volumes"] if v["name"] == "model")
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models/base", "readOnly": True, "subPath": "llama/v1"}
    assert "initContainers" not in pod


def test_model_from_a_host_path(kube_cluster: ControlPlane) -> None:
    pod = agent_pod(render_docs(kube_cluster, "agent.model.hostPath.path=/srv/models/llama"))
    vol = next(v for v in pod["volumes"] if v["name"] == "model")
    assert vol["hostPath"] == {"path": "/srv/models/llama", "type": "Directory"}


def test_model_downloaded_by_an_init_container(kube_cluster: ControlPlane) -> None:
    docs = render_docs(
        kube_cluster, "agent.model.download.url=https://m.example/llama.tar.gz", f"agent.model.download.sha256={SHA}", "image.agent.tag=dev"
    )
    pod = agent_pod(docs)
    (init,) = pod["initContainers"]
    assert init["image"] == pod["containers"][0]["image"] == "ghcr.io/lorafleet/lorafleet-agent:dev"
    assert init["command"] == ["python", "/etc/lorafleet/scripts/fetch-model.py"]
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env == {
        "MODEL_URL": "https://m.example/llama.tar.gz",
        "MODEL_SHA256": SHA,
        "MODEL_DIR": "/models/base",
        "MODEL_ALLOW_HTTP": "0",
        "MODEL_TIMEOUT_S": "3600",
    }
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"]["emptyDir"] == {"sizeLimit": "64Gi"}
    assert vols["scripts"]["configMap"]["name"] == "lf-lorafleet-scripts"
    assert {"name": "model", "mountPath": "/models/base"} in init["volumeMounts"]
    scripts = docs[("ConfigMap", "lf-lorafleet-scripts")]["data"]
    assert scripts["fetch-model.py"] == (CHART / "files" / "fetch-model.py").read_text().rstrip("\n")


def serve_directory(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def fetch_model(
    url: str, sha: str, model_dir: Path, allow_http: bool = True, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "MODEL_URL": url,
        "MODEL_SHA256": sha,
        "MODEL_DIR": str(model_dir),
        "MODEL_ALLOW_HTTP": "1" if allow_http else "0",
        "MODEL_TIMEOUT_S": "30",
    }
    return subprocess.run(
        [python, str(CHART / "files" / "fetch-model.py")], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def make_archive(path: Path, files: dict[str, bytes], top: str = "", link: str = "") -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(f"{top}{link}")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return hashlib.sha256(path.read_bytes()).hexdigest()


#: The init container's interpreters: this environment's, and Debian 12's 3.11.2 (the images'
#: base in the tests, lorafleet_dev.images), which has no tarfile extraction filters.
INTERPRETERS = [pytest.param(sys.executable, id="venv"), pytest.param("/usr/bin/python3", id="debian-3.11.2")]


@pytest.mark.parametrize("python", INTERPRETERS)
def test_fetch_model_checks_and_unpacks(tmp_path: Path, python: str) -> None:
    """The init container's program, run here against a loopback HTTP server."""
    served = tmp_path / "srv"
    served.mkdir()
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\0" * 4096}
    good = make_archive(served / "m.tar.gz", files, top="tiny-llama/")
    linked = make_archive(served / "link.tgz", files, link="evil")
    escaping = make_archive(served / "up.tgz", {**files, "../../escape": b"x"})
    absolute = make_archive(served / "abs.tgz", {**files, "/tmp/lorafleet-absolute": b"x"})
    server, base = serve_directory(served)
    try:
        model = tmp_path / "model"
        model.mkdir()
        (model / "stale").write_text("left by an interrupted attempt")
        proc = fetch_model(f"{base}/m.tar.gz", good, model, python=python)
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in model.iterdir()) == [".lorafleet-model-sha256", "config.json", "model.safetensors"]
        assert (model / "model.safetensors").read_bytes() == files["model.safetensors"]
        again = fetch_model(f"{base}/m.tar.gz", good, model, python=python)
        assert again.returncode == 0 and "already in" in again.stdout

        for url, sha, allow, message in (
            (f"{base}/m.tar.gz", "0" * 64, True, "sha256 mismatch: the archive has " + good),
            (f"{base}/m.tar.gz", good, False, "the scheme must be https (agent.model.download.allowHttp=true"),
            (f"{base}/link.tgz", linked, True, "the archive's 'evil' is not a regular file or directory"),
            (f"{base}/up.tgz", escaping, True, "the archive's '../../escape' lies outside the model directory"),
            (f"{base}/abs.tgz", absolute, True, "the archive's '/tmp/lorafleet-absolute' lies outside"),
            (f"{base}/missing.tgz", good, True, "download failed: HTTP Error 404"),
            (base.replace("http://", "http://u:secret@") + "/m.tar.gz", good, True, "credentials in a URL"),
            (f"{base}/m.tar.gz?x=1", good, True, "a query or fragment is refused"),
        ):
            target = tmp_path / f"t{abs(hash(url + sha))}"
            target.mkdir()
            proc = fetch_model(url, sha, target, allow, python=python)
            assert proc.returncode == 1, (url, proc.stdout)
            assert message in proc.stderr, proc.stderr
            assert "secret" not in proc.stderr
            assert not (target / ".lorafleet-model-sha256").exists()
        # Nothing was written outside the model directories.
        assert not (tmp_path / "escape").exists() and not Path("/tmp/lorafleet-absolute").exists()
    finally:
        server.shutdown()


# ---- helm test, NOTES, uninstall ------------------------------------------------------------


def test_helm_test_pod_checks_every_agent(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, "agent.replicas=3")
    pod = docs[("Pod", "lf-lorafleet-test-agents")]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "/etc/lorafleet/scripts/helm-test.py"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["AGENT_SERVICE"] == "lf-lorafleet-agent.lf-ns.svc"
    assert (env["GRPC_PORT"], env["REPLICAS"], env["TOKEN_FILE"]) == ("50051", "3", "/var/run/lorafleet/auth/token")
    assert "helm-test.py" in docs[("ConfigMap", "lf-lorafleet-scripts")]["data"]
    assert ("Pod", "lf-lorafleet-test-agents") not in render_docs(kube_cluster, "agent.enabled=false")


def test_notes_tell_how_to_use_the_release(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]) -> None:
    out = kube_cluster.helm("install", "lf", str(CHART), "-n", kube_namespace, "--dry-run=server", "--set", MODEL).stdout
    notes = out.split("NOTES:", 1)[1]
    for text in (
        f"kubectl -n {kube_namespace} get la -w",
        f"helm -n {kube_namespace} test lf",
        "port-forward pod/lf-lorafleet-agent-0 50051:grpc",
        "spec:\n    baseModel: tiny-llama",
        f"lf-lorafleet-agent-api.{kube_namespace}.svc:50051",
        "get secret lf-lorafleet-agent-token",
        "pre-delete hook",
    ):
        assert text in notes, text


def test_uninstall_hook_is_rendered_with_its_rbac(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, "uninstall.timeoutSeconds=90")
    hooks = {k: d for k, d in docs.items() if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "pre-delete"}
    assert set(hooks) == {
        ("ServiceAccount", "lf-lorafleet-uninstall"),
        ("Role", "lf-lorafleet-uninstall"),
        ("RoleBinding", "lf-lorafleet-uninstall"),
        ("Job", "lf-lorafleet-uninstall"),
    }
    weights = {k[0]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for k, d in hooks.items()}
    assert weights["Job"] > max(w for kind, w in weights.items() if kind != "Job")
    role = hooks[("Role", "lf-lorafleet-uninstall")]
    assert role["rules"] == [
        {"apiGroups": ["lorafleet.dev"], "resources": ["loraadapters", "lorafleets"], "verbs": ["get", "list", "delete", "patch"]}
    ]
    job = hooks[("Job", "lf-lorafleet-uninstall")]["spec"]["template"]["spec"]
    assert job["serviceAccountName"] == "lf-lorafleet-uninstall"
    (c,) = job["containers"]
    assert c["image"] == "ghcr.io/lorafleet/lorafleet-operator:0.1.0"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"NAMESPACE": "lf-ns", "FLEET": "default", "FINALIZER": "lorafleet.dev/unload", "TIMEOUT_S": "90"}
    # No operator, or no fleet of the chart's: nothing to wait for.
    for sets in (("operator.enabled=false",), ("fleet.create=false",), ("uninstall.cleanup=false",)):
        assert ("Job", "lf-lorafleet-uninstall") not in render_docs(kube_cluster, MODEL, *sets)


def test_uninstall_cleanup_leaves_nothing_held_by_the_finalizer(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    """The hook's program against the real API server with no operator running (the worst
    case: nobody releases the finalizers): after its timeout it removes the operator's
    finalizer, and everything of the fleet is gone; other fleets' adapters are untouched."""
    ns = kube_namespace
    fin = ["lorafleet.dev/unload"]
    fleet = {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraFleet",
        "metadata": {"name": "default", "finalizers": fin},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "lorafleet-agent"}}},
    }

    def adapter(name: str, fleet_name: str) -> dict[str, Any]:
        return {
            "apiVersion": "lorafleet.dev/v1alpha1",
            "kind": "LoraAdapter",
            "metadata": {"name": name, "finalizers": fin},
            "spec": {
                "baseModel": "tiny-llama",
                "fleetRef": {"name": fleet_name},
                "source": {"uri": f"file:///var/lib/lorafleet/adapters/{name}"},
            },
        }

    objs = [fleet, adapter("a1", "default"), adapter("a2", "default"), adapter("other", "elsewhere")]
    kube_cluster.apply("\n---\n".join(yaml.safe_dump(o) for o in objs), ns)
    env = {
        **os.environ,
        "KUBECONFIG": str(kube_cluster.kubeconfig),
        "NAMESPACE": ns,
        "FLEET": "default",
        "FINALIZER": "lorafleet.dev/unload",
        "TIMEOUT_S": "2",
    }
    proc = subprocess.run(
        [sys.executable, str(CHART / "files" / "uninstall-cleanup.py")], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "removed finalizer lorafleet.dev/unload from loraadapters/a1" in proc.stdout
    assert "removed finalizer lorafleet.dev/unload from lorafleets/default" in proc.stdout
    left = kube_cluster.kubectl("get", "loraadapters,lorafleets", "-n", ns, "-o", "name").stdout.split()
    assert left == ["loraadapter.lorafleet.dev/other"]
    kube_cluster.kubectl("patch", "la", "other", "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')


class FakeAgent(agent_pb2_grpc.NodeAgentServicer):
    """Health and Describe as an agent answers them, the token required on Describe."""

    def __init__(self, token: str, model: str) -> None:
        self.token, self.model = token, model

    def Describe(self, request: Any, context: Any) -> Any:
        if ("authorization", f"Bearer {self.token}") not in context.invocation_metadata():
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return agent_pb2.DescribeResponse(base_model=agent_pb2.BaseModel(name=self.model), topology=agent_pb2.Topology(tp_size=2))


def run_helm_test(port: int, token_file: Path, model: str = "tiny-llama") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "AGENT_SERVICE": "127.0.0.1",
        "GRPC_PORT": str(port),
        "REPLICAS": "1",
        "BASE_MODEL": model,
        "TP_SIZE": "2",
        "TOKEN_FILE": str(token_file),
        "TLS_DIR": "",
        "TLS_SERVER_NAME": "",
        "TIMEOUT_S": "3",
    }
    return subprocess.run(
        [sys.executable, str(CHART / "files" / "helm-test.py")], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_helm_test_program_against_an_agent(tmp_path: Path) -> None:
    """The `helm test` pod's program, run here against a loopback gRPC server."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    agent_pb2_grpc.add_NodeAgentServicer_to_server(FakeAgent("s3cret", "tiny-llama"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        good, bad = tmp_path / "good", tmp_path / "bad"
        good.write_text("s3cret\n")
        bad.write_text("wrong")
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        proc = run_helm_test(port, good)
        assert proc.returncode == 1 and "agent 127.0.0.1: health is NOT_SERVING" in proc.stderr
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        proc = run_helm_test(port, good)
        assert proc.returncode == 0, proc.stderr
        assert "agent 127.0.0.1: SERVING, Describe answered (tiny-llama, tp=2)" in proc.stdout
        proc = run_helm_test(port, bad)
        assert proc.returncode == 1 and "UNAUTHENTICATED: missing or wrong bearer token" in proc.stderr
        proc = run_helm_test(port, good, model="other")
        assert proc.returncode == 1 and "serves 'tiny-llama' on tp=2, the chart says 'other'" in proc.stderr
    finally:
        server.stop(None)
