"""The chart's Grafana dashboard: rendered by the real helm binary (off by default), a ConfigMap the
kube-prometheus-stack sidecar loads, valid dashboard JSON whose every query names only metrics the
agent or the operator exports (the metric names their sources declare)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.kube.harness import CHECKOUT

CHART = CHECKOUT.chart
SOURCES = (CHECKOUT.root / "node_agent", CHECKOUT.root / "operator" / "lorafleet_operator")
METRIC_NAME = re.compile(r"^(?:vllm:|lorafleet_)[a-z_:]+$")
# A series name in a PromQL expression (its grouping clauses taken out): an identifier followed by
# a selector, a range, the ")" of the call it is the argument of, or nothing (a bare series).
GROUPING = re.compile(r"\b(?:by|without)\s*\([^)]*\)")
QUERIED = re.compile(r"(?<![\w:{\"])([a-zA-Z_:][\w:]*)\s*(?=[{\[)]|$)")


def render(bin_dir: Path, tmp_path: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(bin_dir / "helm"), "template", "lf", str(CHART), "--namespace", "lf-ns", "--set", "agent.model.pvc.claimName=models"]
    for s in sets:
        args += ["--set", s]
    homes = {var: str(tmp_path / var) for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}
    out = subprocess.run(args, capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin", **homes})
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def exported_metrics() -> set[str]:
    """Every metric name the agent's and the operator's sources declare (string constants)."""
    names = set()
    for root in SOURCES:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC_NAME.match(node.value):
                    names.add(node.value)
    return names


def series_family(name: str) -> str:
    """The family a series name belongs to (a histogram's _bucket/_sum/_count, a counter's _total)."""
    return re.sub(r"_(bucket|sum|count|total)$", "", name)


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_the_dashboard_is_off_by_default(kube_bin_dir: Path, tmp_path: Path) -> None:
    assert not [d for d in render(kube_bin_dir, tmp_path) if d["kind"] == "ConfigMap" and "grafana" in d["metadata"]["name"]]


def test_the_dashboard_queries_only_metrics_lorafleet_exports(kube_bin_dir: Path, tmp_path: Path) -> None:
    docs = render(
        kube_bin_dir, tmp_path, "metrics.grafanaDashboard.enabled=true", "metrics.grafanaDashboard.annotations.grafana_folder=LoRA"
    )
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert config_map["metadata"]["namespace"] == "lf-ns" and config_map["metadata"]["annotations"] == {"grafana_folder": "LoRA"}
    dashboard = json.loads(config_map["data"]["lorafleet.json"])
    assert dashboard["uid"] and dashboard["panels"]

    exported = exported_metrics()
    exported |= {series_family(name) for name in exported}
    queried = {name for expr in queries(dashboard) for name in QUERIED.findall(GROUPING.sub("", expr))}
    assert queried, "the expressions name series"
    unknown = sorted(name for name in queried if name not in exported and series_family(name) not in exported)
    assert unknown == [], f"queried but exported by neither the agent nor the operator: {unknown}"
    wanted = {
        "vllm:lora_requests_info",
        "vllm:lora_adapter_loaded",
        "vllm:num_gpu_loaded_lora_adapters",
        "vllm:max_gpu_lora_adapters",
        "vllm:lora_adapter_load_seconds",
        "vllm:cache_config_info",
        "lorafleet_agent_adapter_requests",
        "lorafleet_agent_adapter_prompt_tokens",
        "lorafleet_agent_adapter_generated_tokens",
        "lorafleet_agent_adapter_time_to_first_token_seconds",
        "lorafleet_agent_adapter_inter_token_latency_seconds",
        "lorafleet_adapter_desired_replicas",
        "lorafleet_adapter_current_replicas",
        "lorafleet_scaling_decisions",
    }
    assert wanted <= {series_family(name) for name in queried}, "a panel for each of the demand loop's metrics"


def test_the_dashboard_can_go_to_the_sidecars_namespace(kube_bin_dir: Path, tmp_path: Path) -> None:
    docs = render(kube_bin_dir, tmp_path, "metrics.grafanaDashboard.enabled=true", "metrics.grafanaDashboard.namespace=monitoring")
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap" and "grafana" in d["metadata"]["name"]]
    assert config_map["metadata"]["namespace"] == "monitoring"
