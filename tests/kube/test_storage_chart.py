"""The chart's storage-source values, rendered by the real helm and read back by the agents' own
parser: the S3 endpoint and region, plain-HTTP registries, s3:// and oci:// prefixes for the
agents and the chart's LoraFleet, a read-only adapter volume that is the file:// root, and the
host memory of standby adapters' snapshots."""

from __future__ import annotations

import pytest

from lorafleet_dev.processes import HarnessError
from node_agent.cli import build_parser
from tests.kube.harness import ControlPlane
from tests.kube.test_chart import MODEL, agent_pod, refusal, render_docs

S3_ALLOW = "s3://adapters/team-a"
OCI_ALLOW = "oci://registry.internal:5000/team-a"


def test_s3_and_oci_values_become_the_agents_flags_and_the_fleets_prefixes(kube_cluster: ControlPlane) -> None:
    docs = render_docs(
        kube_cluster,
        MODEL,
        f"agent.sources.allow={{https://m.example/lora/,{S3_ALLOW},{OCI_ALLOW}}}",
        "agent.sources.s3Endpoint=https://s3.internal.example",
        "agent.sources.s3Region=eu-west-1",
        "agent.sources.ociPlainHttp={registry.internal:5000}",
    )
    container = agent_pod(docs)["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert (args.s3_endpoint, args.s3_region, args.oci_plain_http) == (
        "https://s3.internal.example",
        "eu-west-1",
        ["registry.internal:5000"],
    )
    assert args.allow_source == ["https://m.example/lora/", S3_ALLOW, OCI_ALLOW]
    assert docs[("LoraFleet", "default")]["spec"]["sources"] == {"allow": ["https://m.example/lora/", S3_ALLOW, OCI_ALLOW]}
    # By default no store: s3:// sources are refused by the agents.
    default = agent_pod(render_docs(kube_cluster, MODEL))["containers"][0]
    parsed = build_parser().parse_args(default["command"][1:] + default["args"])
    assert (parsed.s3_endpoint, parsed.oci_plain_http) == ("", [])


def test_an_adapter_volume_is_mounted_read_only_at_the_adapter_root(kube_cluster: ControlPlane) -> None:
    docs = render_docs(
        kube_cluster,
        MODEL,
        "agent.adapterRoot=/mnt/adapters",
        "agent.adapterVolume.persistentVolumeClaim.claimName=team-adapters",
    )
    pod = agent_pod(docs)
    container = pod["containers"][0]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/mnt/adapters")
    assert [str(root) for root in args.adapter_root] == ["/mnt/adapters"] and mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume == {"name": mount["name"], "persistentVolumeClaim": {"claimName": "team-adapters"}}


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_host_memory_for_standby_snapshots_is_a_memory_emptydir_the_agent_and_servers_mount(
    kube_cluster: ControlPlane, backend: str
) -> None:
    pod = agent_pod(render_docs(kube_cluster, MODEL, f"agent.backend={backend}", "agent.standby.hostMemoryMiB=512"))
    agent = pod["containers"][0]
    args = build_parser().parse_args(agent["command"][1:] + agent["args"])
    assert args.standby_memory_mib == 512
    volume = next(v for v in pod["volumes"] if v["name"] == "standby-memory")
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "576Mi"}, "the budget and 64 MiB of page rounding"
    # the agent writes the copies; vLLM servers read the snapshot paths the agent gives them
    assert [c["name"] for c in pod["containers"]] == (["agent"] if backend == "builtin" else ["agent", "vllm-0"])
    for container in pod["containers"]:
        mount = next(m for m in container["volumeMounts"] if m["name"] == "standby-memory")
        assert mount["mountPath"] == str(args.standby_memory_dir)
        assert mount.get("readOnly", False) is (container is not agent)


def test_host_memory_for_standby_snapshots_is_off_by_default(kube_cluster: ControlPlane) -> None:
    pod = agent_pod(render_docs(kube_cluster, MODEL))
    agent = pod["containers"][0]
    assert build_parser().parse_args(agent["command"][1:] + agent["args"]).standby_memory_mib == 0
    assert "standby-memory" not in {v["name"] for v in pod["volumes"]}
    assert "minimum: got -1, want 0" in refusal(kube_cluster, MODEL, "agent.standby.hostMemoryMiB=-1")


@pytest.mark.parametrize(
    "value",
    [
        "agent.sources.allow={s3://a/x}",  # no valid bucket name
        "agent.sources.allow={oci://user@registry/x}",
        "agent.sources.s3Endpoint=ftp://s3.example",
        "agent.sources.ociPlainHttp={http://registry.example}",
    ],
)
def test_storage_values_that_cannot_work_are_refused(kube_cluster: ControlPlane, value: str) -> None:
    with pytest.raises(HarnessError, match="does not match pattern"):
        render_docs(kube_cluster, MODEL, value)
