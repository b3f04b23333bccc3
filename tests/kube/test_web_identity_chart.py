"""The chart's web-identity values (agent.sources.s3WebIdentity), rendered by the real helm and
read back by the agents' own parser: the flags, the agents' ServiceAccount that names the role
(EKS's webhook), and the token the chart projects itself for other clusters."""

from __future__ import annotations

from node_agent.cli import build_parser
from tests.kube.harness import ControlPlane
from tests.kube.test_chart import CHART, MODEL, agent_pod, kinds, refusal, render, render_docs

ROLE = "arn:aws:iam::111122223333:role/adapter-reader"
STORE = "agent.sources.s3Endpoint=https://s3.eu-west-1.amazonaws.com"
ON = ("agent.sources.s3WebIdentity.enabled=true", f"agent.sources.s3WebIdentity.roleArn={ROLE}")


def test_web_identity_on_eks_gives_the_agents_a_service_account_naming_the_role(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, STORE, *ON)
    pod = agent_pod(docs)
    account = docs[("ServiceAccount", "lf-lorafleet-agent")]
    assert pod["serviceAccountName"] == "lf-lorafleet-agent" and pod["automountServiceAccountToken"] is False
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": ROLE}
    container = pod["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert (args.s3_web_identity, args.s3_sts_endpoint) == (True, "")
    # EKS's webhook projects the token and sets the variables; the chart does not.
    assert not {"AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"} & {env["name"] for env in container["env"]}


def test_web_identity_elsewhere_projects_the_token_for_the_sts_audience(kube_cluster: ControlPlane) -> None:
    sets = (
        STORE,
        *ON,
        "agent.sources.s3WebIdentity.tokenAudience=sts.internal",
        "agent.sources.s3WebIdentity.stsEndpoint=https://sts.internal",
    )
    pod = agent_pod(render_docs(kube_cluster, MODEL, *sets))
    container = pod["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert (args.s3_web_identity, args.s3_sts_endpoint) == (True, "https://sts.internal")
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "web-identity-token")
    assert env["AWS_ROLE_ARN"] == ROLE and env["AWS_WEB_IDENTITY_TOKEN_FILE"] == f"{mount['mountPath']}/token"
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "web-identity-token")
    assert volume["projected"]["sources"] == [
        {"serviceAccountToken": {"audience": "sts.internal", "expirationSeconds": 3600, "path": "token"}}
    ]


def test_web_identity_is_off_by_default_and_needs_a_store_and_a_role(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, STORE)
    container = agent_pod(docs)["containers"][0]
    assert build_parser().parse_args(container["command"][1:] + container["args"]).s3_web_identity is False
    assert "serviceAccountName" not in agent_pod(docs) and ("ServiceAccount", "lf-lorafleet-agent") not in docs
    assert "needs agent.sources.s3Endpoint" in refusal(kube_cluster, MODEL, *ON)
    assert "roleArn" in refusal(kube_cluster, MODEL, STORE, ON[0])
    assert "s3WebIdentity" in refusal(kube_cluster, MODEL, STORE, *ON, "agent.sources.s3WebIdentity.stsEndpoint=ftp://sts")


def test_the_web_identity_objects_apply_with_server_dry_run(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev"
    )
    manifest = render(kube_cluster, kube_namespace, MODEL, STORE, *ON, "agent.sources.s3WebIdentity.tokenAudience=sts.internal")
    assert ("ServiceAccount", "lf-lorafleet-agent") in kinds(manifest)
    out = kube_cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", kube_namespace, "-f", "-", input=manifest).stdout
    assert all(line.endswith("(server dry run)") for line in out.splitlines() if line.strip()), out
