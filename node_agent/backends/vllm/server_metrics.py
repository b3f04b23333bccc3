"""A vLLM server's own `/metrics`, read for the requests every client sent it.

`vllm:num_requests_running` and `vllm:num_requests_waiting` count them (summed over the
server's engine cores); `vllm:lora_requests_info` names the adapters they use. vLLM keeps one
series per label set it ever reported, each valued at the time it was last set, so the newest
(the largest value) is the current one, as gateways read it. vLLM 0.32 writes every adapter with
a request into both `running_lora_adapters` and `waiting_lora_adapters` (llm-d-router's reading
in vLLM's PR #54830 says the same), so the waiting names are only as good as the waiting count.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from node_agent.backends.server import Refusal, ServerRequests

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
LORA_INFO = "vllm:lora_requests_info"


def parse_requests(text: str) -> ServerRequests | Refusal:
    """The requests a vLLM server's metrics text says it runs and queues now."""
    try:
        families = {family.name: family.samples for family in text_string_to_metric_families(text)}
    except ValueError as error:
        return Refusal(200, "UnexpectedAnswer", f"/metrics is not Prometheus text: {error}", permanent=False)
    if RUNNING not in families or WAITING not in families:
        return Refusal(200, "UnexpectedAnswer", f"/metrics has no {RUNNING} or {WAITING}", permanent=False)
    running = int(sum(sample.value for sample in families[RUNNING]))
    waiting = int(sum(sample.value for sample in families[WAITING]))
    info = max(families.get(LORA_INFO, []), key=lambda sample: sample.value, default=None)
    if info is None:  # no LoRA request yet (or LoRA off): no adapter named
        return ServerRequests(running, waiting, frozenset(), frozenset())
    return ServerRequests(
        running, waiting, _names(info.labels.get("running_lora_adapters", "")), _names(info.labels.get("waiting_lora_adapters", ""))
    )


def _names(label: str) -> frozenset[str]:
    """A comma-joined label's names (gateways trim each)."""
    return frozenset(name.strip() for name in label.split(",") if name.strip())
