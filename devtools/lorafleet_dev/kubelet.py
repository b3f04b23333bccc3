"""Agent Pods whose status is written the way a kubelet would (a stand-in kubelet).

The local control plane has no kubelet and no scheduler: node agents run as local processes on
127.0.0.1, and their Pod objects only describe them. :class:`StandInKubelet` creates those Pods
bound to :data:`LOCAL_NODE` and writes their status through the status subresource (phase,
IPs, conditions, container statuses), flips readiness, models container restarts and deletes
pods at once. :class:`lorafleet_dev.controlplane.ControlPlane` is one.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from abc import ABC, abstractmethod
from typing import Any

#: The node name written into agent Pods. No Node object exists and no node controller runs,
#: so nothing marks these pods NotReady or garbage-collects them as orphans.
LOCAL_NODE = "lorafleet-local"
#: The name of the vLLM container's port in a vLLM-backed agent pod, as the chart names it.
VLLM_PORT_NAME = "vllm-http"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StandInKubelet(ABC):
    """Agent pods, with status written the way a kubelet would, through ``kubectl``."""

    @abstractmethod
    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run kubectl as the cluster's admin; raise on a non-zero exit."""

    def create_agent_pod(
        self,
        namespace: str,
        name: str,
        port: int,
        *,
        labels: dict[str, str] | None = None,
        ready: bool = True,
        ip: str = "127.0.0.1",
        http_port: int | None = None,
        vllm_port: int | None = None,
    ) -> dict[str, Any]:
        """Create a Pod describing a node agent listening on ``ip:port`` and mark it Running.

        ``http_port``: the agent's OpenAI HTTP API, a second port of the agent container named
        ``http`` (as the chart names it). ``vllm_port``: the agent drives stock vLLM (``--backend vllm``); the pod gets, as the
        chart's do, a ``vllm`` container whose port :data:`VLLM_PORT_NAME` is that server's.
        The pod is bound to LOCAL_NODE (no scheduler) and has terminationGracePeriodSeconds 0,
        so deleting it removes it at once (no kubelet would ever confirm a graceful deletion).
        Returns the Pod as the API server stores it after the status write.
        """
        ports = [{"name": "grpc", "containerPort": port, "protocol": "TCP"}]
        if http_port is not None:
            ports.append({"name": "http", "containerPort": http_port, "protocol": "TCP"})
        containers: list[dict[str, Any]] = [
            {"name": "agent", "image": "lorafleet-agent:local", "command": ["lorafleet-agent", "serve"], "ports": ports}
        ]
        if vllm_port is not None:
            containers.append(
                {
                    "name": "vllm",
                    "image": "vllm-openai:local",
                    "ports": [{"name": VLLM_PORT_NAME, "containerPort": vllm_port, "protocol": "TCP"}],
                }
            )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/name": "lorafleet-agent", **(labels or {})},
            },
            "spec": {
                "nodeName": LOCAL_NODE,
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
                "containers": containers,
            },
        }
        self.kubectl("create", "-f", "-", input=json.dumps(pod))
        return self.write_pod_status(namespace, name, ready=ready, ip=ip)

    def write_pod_status(
        self,
        namespace: str,
        name: str,
        *,
        ready: bool = True,
        ip: str = "127.0.0.1",
        restart_count: int = 0,
        phase: str = "Running",
    ) -> dict[str, Any]:
        """Write a pod's status through the status subresource, as a kubelet does.

        ``restart_count`` > 0 with a fresh start time models a container restart (an agent
        process that came back, having lost its in-memory adapters).
        """
        now = _now()
        ready_s = "True" if ready else "False"
        pod = json.loads(self.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)
        containers = pod["spec"]["containers"]
        status = {
            "phase": phase,
            "hostIP": ip,
            "hostIPs": [{"ip": ip}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": pod.get("status", {}).get("startTime", now),
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready_s, "lastTransitionTime": now},
                {"type": "Ready", "status": ready_s, "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c["image"],
                    "imageID": "",
                    "containerID": f"lorafleet-local://{namespace}/{name}/{c['name']}/{restart_count}",
                    "ready": ready,
                    "started": phase == "Running",
                    "restartCount": restart_count,
                    "state": ({"running": {"startedAt": now}} if phase == "Running" else {"waiting": {"reason": "ContainerCreating"}}),
                }
                for c in containers
            ],
        }
        out = self.kubectl(
            "patch",
            "pod",
            name,
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
            "-o",
            "json",
        )
        return dict(json.loads(out.stdout))

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete a pod immediately (grace period 0), as when an agent pod goes away."""
        self.kubectl("delete", "pod", name, "-n", namespace, "--grace-period=0", "--force", "--ignore-not-found")
