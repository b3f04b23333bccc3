"""Node agents as local processes (``lorafleet-agent serve``) for the demo, tests and benchmarks.

Each agent is one engine (``--tp`` rank processes), or drives stock vLLM servers
(``--backend vllm``, :class:`VllmBackend`; the servers: :mod:`lorafleet_dev.vllm_servers`),
serving gRPC on 127.0.0.1. It runs in its own process group, so a "crash"
(:meth:`AgentProcess.kill`) takes its rank processes with it, and gets SIGTERM when its parent
dies, so nothing outlives the process that started it. Readiness is the standard gRPC health
check, the same the chart's probes use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet_dev.processes import free_port, log_tail, popen_dying_with_parent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmBackend:
    """``--backend vllm``: the stock vLLM servers an agent drives (one rank each, in order) and
    the directory they read the agent's adapter snapshots from (docs/vllm.md)."""

    endpoints: tuple[str, ...]
    cache_dir: Path
    #: The servers' ``--max-loras``.
    max_loras_per_batch: int = 2

    def argv(self) -> list[str]:
        """The ``serve`` flags that select this backend."""
        argv = ["--backend", "vllm", "--cache-dir", str(self.cache_dir), "--max-loras-per-batch", str(self.max_loras_per_batch)]
        for endpoint in self.endpoints:
            argv += ["--vllm-endpoint", endpoint]
        return argv


@dataclass(frozen=True)
class AgentSpec:
    """How to start one agent: its own engine (``tp`` x ``dp`` ranks), or with ``vllm`` the
    stock vLLM servers it names (one rank each)."""

    model_dir: Path
    adapter_roots: tuple[Path, ...]
    base_model_name: str
    tp: int = 2
    dp: int = 2
    max_lora_rank: int = 16
    max_loaded_loras: int = 128
    extra_args: tuple[str, ...] = ()
    #: The address to listen on: loopback, or the machine's own address for an operator running
    #: in a real node's pod (lorafleet_dev.node), which cannot reach this machine's loopback.
    host: str = "127.0.0.1"
    vllm: VllmBackend | None = None
    #: Variables set in the agent's environment on top of ours (e.g. the S3 keys it reads).
    env: tuple[tuple[str, str], ...] = ()

    def argv(self, port: int, metrics_port: int | None = None) -> list[str]:
        """The ``lorafleet-agent serve`` command line for an agent on ``host:port``."""
        argv = [
            "lorafleet-agent",
            "--log-level",
            "INFO",
            "serve",
            "--model",
            str(self.model_dir),
            *(self.vllm.argv() if self.vllm else ["--tp", str(self.tp), "--dp", str(self.dp)]),
            "--listen",
            f"{self.host}:{port}",
            "--base-model-name",
            self.base_model_name,
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loaded-loras",
            str(self.max_loaded_loras),
        ]
        for root in self.adapter_roots:
            argv += ["--adapter-root", str(root)]
        # Local agents download only from loopback test servers (docs/agent.md, Sources).
        argv += ["--allow-source", "http://127.0.0.1:*/", "--allow-source-network", "127.0.0.0/8"]
        if metrics_port:
            argv += ["--metrics-port", str(metrics_port)]
        return argv + list(self.extra_args)


PORT_RETRIES = 3  # new ports for a first start that lost its port to another process


@dataclass
class AgentProcess:
    """One running agent; :meth:`start` again after :meth:`kill` models a restarted container."""

    name: str
    spec: AgentSpec
    log_dir: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def endpoint(self) -> str:
        """``host:port`` of the agent's gRPC server."""
        return f"{self.spec.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where the agent's (and its ranks') output goes."""
        return self.log_dir / f"{self.name}.log"

    def start(self) -> AgentProcess:
        """Start the process (same port every time) without waiting for it."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **dict(self.spec.env)} if self.spec.env else None
        self.popen = popen_dying_with_parent(self.spec.argv(self.port, self.metrics_port), self.log_path, new_session=True, env=env)
        self.starts += 1
        log.info("started agent %s (pid %d) on %s", self.name, self.popen.pid, self.endpoint)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> AgentProcess:
        """Wait until grpc.health.v1 says SERVING; raise with the log tail if it exits.

        A first start whose port another process took after `free_port` chose it (the agent
        exits with "Address already in use") is started again on new ports, at most
        `PORT_RETRIES` times; a restart keeps its ports (it models a restarted container).
        `free_port` keeps this harness's processes off each other's ports and off the kernel's;
        this covers what it cannot: another program on the machine binding a port of the block."""
        deadline = time.monotonic() + timeout_s
        retries = 0
        while True:
            try:
                if self.serving():
                    return self
            except RuntimeError:
                if self.starts != 1 or retries >= PORT_RETRIES or "Address already in use" not in self.log_tail():
                    raise
                retries += 1
                log.warning("agent %s lost its port to another process; starting it on new ports", self.name)
                self.port, self.metrics_port = free_port(), free_port()
                self.starts = 0  # the start below is still this process's first
                self.start()
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent {self.name} not serving after {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def serving(self) -> bool:
        """One health check: whether grpc.health.v1 says SERVING now; raises with the log tail
        if the process has exited."""
        if self.popen is None or self.popen.poll() is not None:
            raise RuntimeError(f"agent {self.name} exited:\n{self.log_tail()}")
        with grpc.insecure_channel(self.endpoint) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def kill(self) -> None:
        """SIGKILL the whole process group: the agent and its ranks die at once (a crash)."""
        self._signal_group(signal.SIGKILL)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it does not exit in time."""
        self._signal_group(signal.SIGTERM, timeout_s)

    def _signal_group(self, sig: int, timeout_s: float = 20.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        except ProcessLookupError:
            pass
        # Rank processes share the group; make sure none lingers holding the port or memory.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the agent's log."""
        return log_tail(self.log_path, lines)


def start_agents(names: Sequence[str], spec: AgentSpec, log_dir: Path, timeout_s: float = 180.0) -> list[AgentProcess]:
    """Start several agents at once and wait for all (they load their models in parallel)."""
    agents = [AgentProcess(name, spec, log_dir).start() for name in names]
    try:
        for agent in agents:
            agent.wait_ready(timeout_s)
    except BaseException:
        for agent in agents:
            agent.stop()
        raise
    return agents
