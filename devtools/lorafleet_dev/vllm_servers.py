"""Stock vLLM OpenAI servers as local processes, for the tests that drive them through agents
started with ``--backend vllm`` (docs/vllm.md).

The servers come from the CPU build ``scripts/build-vllm.sh`` installs (an environment of its
own: it pins an older torch). Each server is one process group (API server, engine core and
worker), pinned to one core with one thread, with runtime LoRA updating on; it gets SIGTERM
when its parent dies, like every server this harness starts. :meth:`VllmProcess.start` again
after :meth:`VllmProcess.kill` models a restarted server: same port, no adapters.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet_dev.processes import HarnessError, free_port, log_tail, popen_dying_with_parent

#: How long a cold server may take to load the model and compile on a loaded CPU.
STARTUP_TIMEOUT_S = 600.0


def vllm_python(checkout: Path) -> str | None:
    """The python of the vLLM environment ``scripts/build-vllm.sh`` installed for ``checkout``;
    None when it is not installed (nothing is built here: a cold install takes minutes)."""
    found = subprocess.run(
        ["bash", str(checkout / "scripts/build-vllm.sh"), "--print-python", "--no-build"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() if found.returncode == 0 else None


@dataclass(frozen=True)
class VllmSettings:
    """What one server serves and its LoRA capacity: ``--max-lora-rank``, ``--max-loras`` and
    ``--max-cpu-loras`` are the driving agent's ``--max-lora-rank``, ``--max-loras-per-batch``
    and ``--max-loaded-loras`` (docs/vllm.md, The servers)."""

    python: str
    model: Path
    max_lora_rank: int = 16
    max_loras: int = 2
    max_cpu_loras: int = 4
    #: The address to listen on: the machine's own for a server a Pod's port names.
    host: str = "127.0.0.1"

    def argv(self, port: int) -> list[str]:
        """The server's command line on ``host:port``: fp32, a short context, a small KV cache
        and no tokenizer (the tiny test models have none; the agent sends token ids)."""
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--host", self.host, "--port", str(port),
            "--dtype", "float32", "--max-model-len", "256", "--skip-tokenizer-init",
            "--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
            "--max-cpu-loras", str(self.max_cpu_loras), "--kv-cache-memory-bytes", str(64 << 20),
        ]  # fmt: skip


@dataclass
class VllmProcess:
    """One vLLM OpenAI server, in its own process group (the engine core and worker too)."""

    name: str
    settings: VllmSettings
    #: The CPU core its one OpenMP thread is bound to (modulo the machine's cores).
    core: int
    log_dir: Path
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL, what ``--vllm-endpoint`` takes."""
        return f"http://{self.settings.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where the server's output goes (appended across restarts)."""
        return self.log_dir / f"{self.name}.log"

    def start(self) -> VllmProcess:
        """Start the server (same port every time) without waiting for it."""
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core % (os.cpu_count() or 1)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.popen = popen_dying_with_parent(self.settings.argv(self.port), self.log_path, new_session=True, env=env)
        return self

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> VllmProcess:
        """Wait until ``/v1/models`` answers; raise with the log tail if the server exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen is None or self.popen.poll() is not None:
                raise HarnessError(f"vLLM server {self.name} exited:\n{log_tail(self.log_path)}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                if answer.status == 200:
                    return self
            time.sleep(0.5)
        raise HarnessError(f"vLLM server {self.name} not serving after {timeout_s:.0f}s:\n{log_tail(self.log_path)}")

    def adapters(self) -> dict[str, str]:
        """What the server holds, from its ``/v1/models``: adapter id -> path (the entries
        whose ``parent`` is the base model)."""
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as answer:
            entries = json.load(answer)["data"]
        base = next(entry["id"] for entry in entries if entry["parent"] is None)
        return {entry["id"]: entry["root"] for entry in entries if entry["parent"] == base}

    def kill(self) -> None:
        """SIGKILL the whole process group (a crashed server) and reap it."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        self.popen = None


def start_vllm_servers(servers: Sequence[VllmProcess], timeout_s: float = STARTUP_TIMEOUT_S) -> list[VllmProcess]:
    """Start several servers at once and wait for all (they load in parallel); on a failure
    every one is killed."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout_s)
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return list(servers)
