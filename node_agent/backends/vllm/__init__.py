"""Stock vLLM OpenAI servers behind the agent's seam (`lorafleet-agent serve --backend vllm`,
docs/vllm.md): each server a rank, driven over its runtime-LoRA HTTP API."""

from collections.abc import Sequence
from pathlib import Path

from node_agent.backend import Capacity
from node_agent.backends.servers_backend import ServersBackend, ServersConfig
from node_agent.backends.vllm.client import VllmServer
from node_agent.engine import validate_adapter

KIND = "vllm"


def vllm_backend(endpoints: Sequence[str], model_dir: Path, capacity: Capacity) -> ServersBackend:
    """A backend over the vLLM servers at `endpoints` ("http://host:port", one per rank),
    serving the base model in `model_dir` with the capacity they were started with; adapters
    are validated against the base model's shapes and `capacity.max_lora_rank` before any
    server is asked."""
    servers = [VllmServer(url) for url in endpoints]
    return ServersBackend(
        servers,
        ServersConfig(KIND, model_dir, capacity),
        lambda path: validate_adapter(path, model_dir, capacity.max_lora_rank),
    )


__all__ = ["KIND", "VllmServer", "vllm_backend"]
