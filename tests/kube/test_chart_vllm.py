"""The Helm chart with `agent.backend: vllm`: the agent as a sidecar of stock vLLM servers.

Everything goes through the real helm binary, as in test_chart.py: the agent's command line is
parsed with the agent's own parser, the servers' with vLLM's (where the vLLM environment is
installed), and the rendering is applied to the test control plane as a server-side dry run.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet_dev.vllm_servers import vllm_python
from tests.kube.harness import CHECKOUT, ControlPlane
from tests.kube.test_chart import MODEL, agent_pod, kinds, refusal, render, render_docs

VLLM = "agent.backend=vllm"
STATEFULSET = ("StatefulSet", "lf-lorafleet-agent")
SNAPSHOTS = "/var/cache/lorafleet"


def containers(docs: dict[tuple[str, str], Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in agent_pod(docs)["containers"]}


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_builtin_backend_renders_no_vllm_server(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, "networkPolicy.enabled=true")
    pod = agent_pod(docs)
    assert [c["name"] for c in pod["containers"]] == ["agent"]
    assert docs[STATEFULSET]["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm", "vLLM's metric names"
    agent = pod["containers"][0]
    assert not any(a.startswith(("--backend", "--vllm-endpoint")) for a in agent["args"])
    assert {"--tp=1", "--device=cuda", "--engine-startup-timeout-s=300"} <= set(agent["args"])
    assert mounts(agent)["/dev/shm"]["name"] == "dshm"
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not any(v["name"].startswith("vllm-") for v in pod["volumes"])
    for service in ("lf-lorafleet-agent", "lf-lorafleet-agent-api"):
        assert not any(p["name"].startswith("vllm-") for p in docs[("Service", service)]["spec"]["ports"])
    policy = docs[("NetworkPolicy", "lf-lorafleet-agent")]["spec"]["ingress"][0]["ports"]
    assert [p["port"] for p in policy] == ["grpc", "metrics", "http"]


def test_agent_drives_one_vllm_server_beside_it(kube_cluster: ControlPlane) -> None:
    from node_agent.cli import build_parser

    docs = render_docs(kube_cluster, MODEL, VLLM, "agent.maxLoraRank=32", "agent.maxLorasPerBatch=4", "agent.maxLoadedLoras=24")
    assert docs[STATEFULSET]["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    by_name = containers(docs)
    assert list(by_name) == ["agent", "vllm-0"]
    agent, server = by_name["agent"], by_name["vllm-0"]

    args = build_parser().parse_args(agent["command"][1:] + agent["args"])
    assert (args.backend, args.vllm_endpoint) == ("vllm", ["http://127.0.0.1:8200"])
    assert (str(args.cache_dir), str(args.model)) == (SNAPSHOTS, "/models/base")
    assert (args.max_lora_rank, args.max_loras_per_batch, args.max_loaded_loras) == (32, 4, 24)
    assert args.listen == "0.0.0.0:50051" and str(args.auth_token_file) == "/var/run/lorafleet/auth/token"
    # The builtin engine's flags are not given (their defaults are unused with --backend vllm).
    assert not any(a.startswith(("--tp=", "--device=", "--engine-startup-timeout-s=")) for a in agent["args"])
    assert "nvidia.com/gpu" not in json.dumps(agent["resources"])

    assert server["image"] == "vllm/vllm-openai:v0.32.0"
    assert server["command"] == ["vllm", "serve"]
    assert server["args"] == [
        "/models/base",
        "--served-model-name=tiny-llama",
        "--host=0.0.0.0",
        "--port=8200",
        "--enable-lora",
        "--max-lora-rank=32",
        "--max-loras=4",
        "--max-cpu-loras=24",
    ]
    assert plain_env(server)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert server["ports"] == [{"name": "vllm-http", "containerPort": 8200, "protocol": "TCP"}]
    assert server["resources"]["requests"]["nvidia.com/gpu"] == server["resources"]["limits"]["nvidia.com/gpu"] == 1

    # vLLM's /health; the start-up probe allows agent.vllm.startupTimeoutSeconds (model load).
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "vllm-http"}
        assert agent[probe]["grpc"] == {"port": 8081}
    startup = server["startupProbe"]
    assert 1800 <= startup["periodSeconds"] * startup["failureThreshold"] < 1810


def test_vllm_servers_share_the_agents_files_and_user(kube_cluster: ControlPlane) -> None:
    docs = render_docs(kube_cluster, MODEL, "agent.model.pvc.subPath=llama", VLLM, "agent.vllm.servers=2")
    pod = agent_pod(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    by_name = containers(docs)
    agent = mounts(by_name["agent"])
    assert agent[SNAPSHOTS]["name"] == "cache" and not agent[SNAPSHOTS].get("readOnly")
    assert "/dev/shm" not in agent
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == 65532
    tmp_volumes = set()
    for name in ("vllm-0", "vllm-1"):
        server = by_name[name]
        # Snapshots are mode 0700, the agent's: every server runs as the agent's user and group.
        assert server["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "runAsUser": 65532,
            "runAsGroup": 65532,
        }
        found = mounts(server)
        # The adapter snapshots at the agent's path (lora_path is the agent's), read-only.
        assert found[SNAPSHOTS] == {"name": "cache", "mountPath": SNAPSHOTS, "readOnly": True}
        assert found["/models/base"] == {"name": "model", "mountPath": "/models/base", "readOnly": True, "subPath": "llama"}
        assert found["/dev/shm"]["name"] == "dshm"
        # Where vLLM writes: its own /tmp emptyDir (HOME and every cache), with a size limit.
        tmp = found["/tmp"]["name"]
        assert "sizeLimit" in volumes[tmp]["emptyDir"] and not found["/tmp"].get("readOnly")
        tmp_volumes.add(tmp)
        env = plain_env(server)
        assert env["HOME"] == "/tmp"
        assert all(env[key].startswith("/tmp/") for key in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"))
    assert tmp_volumes == {"vllm-tmp-0", "vllm-tmp-1"}


def test_two_vllm_servers_are_two_ranks_and_two_named_ports(kube_cluster: ControlPlane) -> None:
    docs = render_docs(
        kube_cluster,
        MODEL,
        VLLM,
        "agent.vllm.servers=2",
        "agent.vllm.gpus=2",
        "agent.vllm.gpuMemoryUtilization=0.85",
        "agent.vllm.extraArgs={--max-model-len=4096}",
        "networkPolicy.enabled=true",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
        "metrics.serviceMonitor.enabled=true",
    )
    by_name = containers(docs)
    assert list(by_name) == ["agent", "vllm-0", "vllm-1"]
    endpoints = [a for a in by_name["agent"]["args"] if a.startswith("--vllm-endpoint=")]
    assert endpoints == ["--vllm-endpoint=http://127.0.0.1:8200", "--vllm-endpoint=http://127.0.0.1:8201"]
    for index, (name, port) in enumerate((("vllm-http", 8200), ("vllm-http-1", 8201))):
        server = by_name[f"vllm-{index}"]
        assert server["ports"] == [{"name": name, "containerPort": port, "protocol": "TCP"}]
        assert server["args"][3:4] == [f"--port={port}"]
        assert server["args"][-3:] == ["--tensor-parallel-size=2", "--gpu-memory-utilization=0.85", "--max-model-len=4096"]
        assert server["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert server["readinessProbe"]["httpGet"]["port"] == name

    vllm_ports = [{"name": "vllm-http", "port": 8200, "targetPort": "vllm-http", "protocol": "TCP"}]
    vllm_ports.append({"name": "vllm-http-1", "port": 8201, "targetPort": "vllm-http-1", "protocol": "TCP"})
    for service in ("lf-lorafleet-agent", "lf-lorafleet-agent-api"):
        assert docs[("Service", service)]["spec"]["ports"][-2:] == vllm_ports
    # The adapters' Service names the one vLLM port the operator's EndpointSlices list.
    adapter_ports = docs[("Service", "lf-lorafleet-adapters")]["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in adapter_ports] == [("grpc", 50051), ("http", 8000), ("vllm-http", 8200)]
    # Prometheus scrapes vLLM's own /metrics on each server's port, beside the agent's.
    scraped = [(e["port"], e["path"]) for e in docs[("ServiceMonitor", "lf-lorafleet-agent")]["spec"]["endpoints"]]
    assert scraped == [("metrics", "/metrics"), ("vllm-http", "/metrics"), ("vllm-http-1", "/metrics")]
    clients, metrics = docs[("NetworkPolicy", "lf-lorafleet-agent")]["spec"]["ingress"]
    assert [p["port"] for p in clients["ports"]] == ["grpc", "metrics", "http", "vllm-http", "vllm-http-1"]
    assert [p["port"] for p in metrics["ports"]] == ["metrics", "vllm-http", "vllm-http-1"]


@pytest.mark.parametrize("servers", [1, 2])
def test_vllm_rendering_applies_with_server_dry_run(kube_cluster: ControlPlane, kube_namespace: str, servers: int) -> None:
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CHECKOUT.crds))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev"
    )
    manifest = render(kube_cluster, kube_namespace, MODEL, VLLM, f"agent.vllm.servers={servers}", "networkPolicy.enabled=true")
    out = kube_cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", kube_namespace, "-f", "-", input=manifest).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == len(kinds(manifest)) and all(ln.endswith("(server dry run)") for ln in lines), out


#: Parses `vllm serve` command lines with vLLM's own parser (vLLM 0.32's module layout).
VLLM_PARSE = """
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
ServeSubcommand().subparser_init(parser.add_subparsers())
keys = ("model_tag", "served_model_name", "port", "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
        "tensor_parallel_size")
for argv in json.load(sys.stdin):
    args = parser.parse_args(["serve", *argv])
    print(json.dumps({key: getattr(args, key) for key in keys}))
"""


def test_vllm_args_parse_with_vllms_own_parser(kube_cluster: ControlPlane) -> None:
    """The servers' command lines are ones the vLLM the backend is tested with accepts."""
    python = vllm_python(CHECKOUT.root)
    if python is None:
        pytest.skip("the vLLM environment is not installed (scripts/build-vllm.sh)")
    docs = render_docs(kube_cluster, MODEL, VLLM, "agent.vllm.servers=2", "agent.vllm.gpus=2")
    argv = [c["args"] for name, c in containers(docs).items() if name != "agent"]
    out = subprocess.run([python, "-c", VLLM_PARSE], input=json.dumps(argv), capture_output=True, text=True, timeout=600, check=True)
    parsed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    expected = {
        "model_tag": "/models/base",
        "served_model_name": ["tiny-llama"],
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 8,
        "max_cpu_loras": 32,
        "tensor_parallel_size": 2,
    }
    assert parsed == [{**expected, "port": 8200}, {**expected, "port": 8201}]


VLLM_REFUSALS = [
    (("agent.backend=sglang",), "at '/agent/backend'"),
    ((VLLM, "agent.vllm.tag="), "agent.backend=vllm needs agent.vllm.image and agent.vllm.tag"),
    ((VLLM, "agent.vllm.image="), "agent.backend=vllm needs agent.vllm.image and agent.vllm.tag"),
    ((VLLM, "agent.vllm.servers=0"), "agent.vllm.servers (0) must be at least 1 with agent.backend=vllm"),
    ((VLLM, "fleet.allowPinning=true"), "fleet.allowPinning=true cannot be expressed with agent.backend=vllm"),
    (
        (VLLM, "agent.maxLoadedLoras=4", "agent.maxLorasPerBatch=8"),
        "agent.maxLoadedLoras (4) must be at least agent.maxLorasPerBatch (8) with agent.backend=vllm",
    ),
    (
        (VLLM, "agent.vllm.port=7999", "agent.vllm.servers=2"),
        "the vLLM servers' ports (agent.vllm.port 7999 to 8000, one per server) must not include the agent's port 8000",
    ),
    ((VLLM, "agent.vllm.port=65535", "agent.vllm.servers=2"), "agent.vllm.port (65535) + agent.vllm.servers (2) - 1 is over 65535"),
    ((VLLM, "agent.vllm.extraArgs={--max-loras=4}"), "agent.vllm.extraArgs has --max-loras=4, which the chart sets itself"),
    ((VLLM, "agent.vllm.extraArgs={--max_lora_rank=64}"), "agent.vllm.extraArgs has --max_lora_rank=64, which the chart sets itself"),
    ((VLLM, "agent.vllm.gpuMemoryUtilization=1.5"), "at '/agent/vllm/gpuMemoryUtilization'"),
]


@pytest.mark.parametrize(("sets", "message"), VLLM_REFUSALS, ids=[",".join(s) for s, _ in VLLM_REFUSALS])
def test_inconsistent_vllm_values_are_refused(kube_cluster: ControlPlane, sets: tuple[str, ...], message: str) -> None:
    assert message in refusal(kube_cluster, MODEL, *sets)


def test_the_guides_values_render(kube_cluster: ControlPlane, tmp_path: Path) -> None:
    """docs/vllm.md's "With the Helm chart" example is a values file the chart accepts."""
    guide = (CHECKOUT.root / "docs" / "vllm.md").read_text()
    example = re.search(r"```yaml\n(# values-vllm\.yaml.*?)```", guide, re.DOTALL)
    assert example is not None
    values = tmp_path / "values-vllm.yaml"
    values.write_text(example.group(1))
    manifest = kube_cluster.helm("template", "lf", str(CHECKOUT.chart), "-f", str(values)).stdout
    sts = next(d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "StatefulSet")
    names = [c["name"] for c in sts["spec"]["template"]["spec"]["containers"]]
    assert names == ["agent", "vllm-0", "vllm-1"]


def test_builtin_topology_rules_do_not_bind_the_vllm_sidecar(kube_cluster: ControlPlane) -> None:
    """agent.gpus and agent.tpSize are the builtin engine's: the vLLM servers' GPUs are
    agent.vllm.gpus, so a GPU-less agent beside GPU servers is no inconsistency."""
    docs = render_docs(kube_cluster, MODEL, VLLM, "agent.gpus=0")
    assert containers(docs)["vllm-0"]["resources"]["limits"]["nvidia.com/gpu"] == 1
