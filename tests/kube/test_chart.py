"""The Helm chart: lint, render, server-side dry run, and the operator's RBAC.

The chart's RBAC is checked against the real authorizer (``kubectl auth can-i`` impersonating
the operator's ServiceAccount), both for what it must allow and for what it must not.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.kube.harness import CHECKOUT, ControlPlane

CHART = CHECKOUT.chart


def test_helm_lint(kube_cluster: ControlPlane) -> None:
    out = kube_cluster.helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def render(cluster: ControlPlane, namespace: str, *sets: str) -> str:
    args = ["template", "lf", str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    return cluster.helm(*args).stdout


def kinds(manifest: str) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(manifest) if d]


VARIANTS = [
    pytest.param((), id="defaults"),
    pytest.param(("fleet.authTokenSecret=agent-token", "fleet.tlsSecret=agent-tls",
                  "agent.gpus=0", "agent.device=cpu", "agent.tpSize=2", "agent.dpSize=2",
                  "operator.replicas=2", "image.tag=dev"), id="auth-tls-cpu"),
    pytest.param(("agent.enabled=false", "fleet.create=false", "serviceAccount.name=op"),
                 id="operator-only"),
]


@pytest.mark.parametrize("sets", VARIANTS)
def test_helm_template_applies_with_server_dry_run(
    kube_cluster: ControlPlane, kube_namespace: str, sets: tuple[str, ...]
) -> None:
    # The chart's own CRDs first, for real (helm installs crds/ before the templates).
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                         "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev")
    manifest = render(kube_cluster, kube_namespace, *sets)
    objects = kinds(manifest)
    assert ("Role", "lf-lorafleet-operator") in objects
    out = kube_cluster.kubectl("apply", "--dry-run=server", "--validate=strict",
                               "-n", kube_namespace, "-f", "-", input=manifest).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == len(objects), out
    assert all(ln.endswith("(server dry run)") for ln in lines), out
    # A dry run stores nothing.
    assert kube_cluster.kubectl("get", "roles", "-n", kube_namespace, "-o", "name").stdout == ""


def test_rendered_workloads(kube_cluster: ControlPlane) -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all(render(kube_cluster, "lf-ns", "agent.gpus=2")) if d}
    sts: dict[str, Any] = docs[("StatefulSet", "lf-lorafleet-agent")]
    pod = sts["spec"]["template"]
    agent = pod["spec"]["containers"][0]
    assert agent["command"] == ["lorafleet-agent", "serve"]
    assert agent["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert agent[probe]["grpc"] == {"port": 50051}
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert agent["resources"]["requests"]["nvidia.com/gpu"] == 2

    fleet = docs[("LoraFleet", "default")]
    selector = fleet["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/name"] == "lorafleet-agent"
    assert selector.items() <= pod["metadata"]["labels"].items()

    op = docs[("Deployment", "lf-lorafleet-operator")]["spec"]["template"]["spec"]
    assert op["serviceAccountName"] == "lf-lorafleet-operator"
    assert op["containers"][0]["command"] == ["lorafleet-operator"]


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
    ("get", "loraadapters.lorafleet.dev"), ("list", "loraadapters.lorafleet.dev"),
    ("watch", "loraadapters.lorafleet.dev"), ("patch", "loraadapters.lorafleet.dev"),
    ("update", "loraadapters.lorafleet.dev"),
    ("patch", "loraadapters.lorafleet.dev#status"), ("update", "loraadapters.lorafleet.dev#status"),
    ("list", "lorafleets.lorafleet.dev"), ("watch", "lorafleets.lorafleet.dev"),
    ("patch", "lorafleets.lorafleet.dev#status"),
    ("list", "pods"), ("watch", "pods"), ("get", "pods"),
    ("get", "secrets/agent-token"),
    ("create", "events"), ("create", "events.events.k8s.io"),
    ("create", "leases.coordination.k8s.io"),
    ("update", "leases.coordination.k8s.io/lorafleet-operator"),
]

DENIED = [
    ("create", "loraadapters.lorafleet.dev"), ("delete", "loraadapters.lorafleet.dev"),
    ("delete", "lorafleets.lorafleet.dev"),
    ("create", "pods"), ("delete", "pods"), ("patch", "pods"), ("patch", "pods#status"),
    ("list", "secrets"), ("watch", "secrets"), ("create", "secrets"),
    ("update", "leases.coordination.k8s.io/someone-elses-lease"),
    ("delete", "events"), ("list", "configmaps"), ("create", "deployments.apps"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
]


def can_i(cluster: ControlPlane, user: str, verb: str, resource: str, ns: str) -> bool:
    """Ask the API server's authorizer; ``resource`` is "res[/name][#subresource]"."""
    resource, _, sub = resource.partition("#")
    extra = [f"--subresource={sub}"] if sub else []
    proc = cluster.kubectl("auth", "can-i", verb, resource, *extra, "-n", ns, "--as", user,
                           check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stderr
    return proc.stdout.strip() == "yes"


def test_operator_rbac_is_enough_and_no_broader(
    kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...]
) -> None:
    manifest = render(kube_cluster, kube_namespace, "agent.enabled=false", "operator.enabled=false",
                      "fleet.create=false")
    kube_cluster.kubectl("apply", "--validate=strict", "-n", kube_namespace, "-f", "-",
                         input=manifest)
    sa = f"system:serviceaccount:{kube_namespace}:lf-lorafleet-operator"
    wrong_allowed = [(v, r) for v, r in DENIED if can_i(kube_cluster, sa, v, r, kube_namespace)]
    wrong_denied = [(v, r) for v, r in ALLOWED
                    if not can_i(kube_cluster, sa, v, r, kube_namespace)]
    assert (wrong_denied, wrong_allowed) == ([], [])

    # Nothing outside its namespace: no cluster-wide grant hides in the chart.
    other = kube_cluster.create_namespace(prefix="other")
    try:
        for verb, resource in (("list", "pods"), ("get", "secrets/agent-token"),
                               ("list", "loraadapters.lorafleet.dev")):
            assert not can_i(kube_cluster, sa, verb, resource, other), (verb, resource)
    finally:
        kube_cluster.delete_namespace(other)
    cluster_roles = kube_cluster.kubectl("get", "clusterroles", "-l",
                                         "app.kubernetes.io/instance=lf", "-o", "name").stdout
    assert cluster_roles == ""


def test_watch_namespaces_get_their_own_roles(kube_cluster: ControlPlane) -> None:
    manifest = render(kube_cluster, "lf-system", "operator.watchNamespaces={team-a,team-b}")
    roles = [(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"])
             for d in yaml.safe_load_all(manifest) if d and d["kind"] in ("Role", "RoleBinding")]
    assert ("Role", "team-a", "lf-lorafleet-operator") in roles
    assert ("RoleBinding", "team-b", "lf-lorafleet-operator") in roles
    assert ("Role", "lf-system", "lf-lorafleet-operator-leader-election") in roles
    assert ("Role", "lf-system", "lf-lorafleet-operator") not in roles
    deploy = next(d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LORAFLEET_WATCH_NAMESPACES"] == "team-a,team-b"


@pytest.mark.parametrize("sets", VARIANTS[:2])
def test_agent_args_parse_with_the_agents_own_parser(
    kube_cluster: ControlPlane, sets: tuple[str, ...]
) -> None:
    """The StatefulSet's command line is one `lorafleet-agent serve` accepts, meaning what the
    values say (the chart follows node_agent/cli.py, not guesses)."""
    from node_agent.cli import build_parser

    docs = {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all(render(kube_cluster, "lf-ns", *sets)) if d}
    agent = docs[("StatefulSet", "lf-lorafleet-agent")]["spec"]["template"]["spec"]
    container = agent["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert args.listen == "0.0.0.0:50051"
    assert args.base_model_name == "tiny-llama"
    assert str(args.model) == "/models/base"
    assert [str(r) for r in args.adapter_root] == ["/var/lib/lorafleet/adapters"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {str(args.model), str(args.adapter_root[0]), str(args.cache_dir)} <= mounts
    if "agent.tpSize=2" in sets:
        assert (args.tp, args.dp, args.device) == (2, 2, "cpu")
        assert str(args.auth_token_file) == "/var/run/lorafleet/auth/token"
        assert (str(args.tls_cert), str(args.tls_key), str(args.tls_client_ca)) == (
            "/var/run/lorafleet/tls/tls.crt", "/var/run/lorafleet/tls/tls.key",
            "/var/run/lorafleet/tls/ca.crt")
    else:
        assert (args.tp, args.dp, args.device, args.max_lora_rank) == (1, 1, "cuda", 16)
        assert args.auth_token_file is None and args.tls_cert is None
