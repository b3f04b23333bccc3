"""The signals gateways read, parsed with prometheus_client's own parser from the session's real
agent (tp=2, dp=2) while concurrent streams run and wait, each checked against the engine's and
the registry's state: vLLM's request and LoRA gauges, the residency metrics of vLLM's PR #54830
(resident adapters at level gpu, standby ones at level cpu), the cache config, the load
histogram of a standby adapter's first request, the per-adapter request metrics, and `parent`
in /v1/models."""

from __future__ import annotations

import asyncio
from typing import Any

from node_agent.adapter_metrics import BASE_LABEL
from tests.agent.helpers import ADAPTER_RANK, make_adapter, wait_until
from tests.http.conftest import ADAPTERS, BASE, MAX_NUM_SEQS, all_blocks_free, scrape, scrape_while_busy

STANDBY, PINNED = "gm-standby", "gm-pinned"


def residency(metrics: dict[str, list[Any]]) -> dict[str, tuple[str, str, str]]:
    """vllm:lora_adapter_loaded as adapter -> (level, pinned, rank), every sample's value 1."""
    samples = metrics["vllm:lora_adapter_loaded"]
    assert all(sample.value == 1 for sample in samples)
    return {s.labels["adapter_name"]: (s.labels["level"], s.labels["pinned"], s.labels["rank"]) for s in samples}


def sample(metrics: dict[str, list[Any]], family: str, name: str, **labels: str) -> float:
    """The value of one sample of `family` (0 when there is none)."""
    return sum(s.value for s in metrics.get(family, []) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def load(served, name: str, seed: int, **kwargs: bool) -> None:
    path = make_adapter(served.agent.config.sources.adapter_roots[0] / name, seed=seed)
    assert served.agent.load(name, path.as_uri(), **kwargs).ok


def test_gateway_and_residency_metrics_follow_the_engine_while_requests_run(served, client):
    url = f"{served.base_url}/metrics"
    load(served, STANDBY, seed=600, standby=True)
    load(served, PINNED, seed=601, pinned=True)
    try:
        models = {card.id: card for card in client.models.list().data}
        assert models[BASE].model_extra["parent"] is None
        assert {models[name].model_extra["parent"] for name in (*ADAPTERS, STANDBY, PINNED)} == {BASE}, "vLLM's parent: the base model"

        metrics = asyncio.run(scrape_while_busy(served, url)).metrics
        stats = served.agent.engine.serving_stats()
        rank = str(ADAPTER_RANK)
        assert residency(metrics) == {
            "ad-a": ("gpu", "false", rank),
            "ad-b": ("gpu", "false", rank),
            PINNED: ("gpu", "true", rank),
            STANDBY: ("cpu", "false", rank),
        }
        assert metrics["vllm:num_gpu_loaded_lora_adapters"][0].value == len(served.agent.registry.held()) == 3
        assert metrics["vllm:max_gpu_lora_adapters"][0].value == served.agent.backend.capacity.max_loaded_loras == 8
        [info] = metrics["vllm:lora_requests_info"]
        assert info.labels == {"running_lora_adapters": "ad-a", "waiting_lora_adapters": "ad-b", "max_lora": "4"}
        assert metrics["vllm:num_requests_running"][0].value == MAX_NUM_SEQS
        assert metrics["vllm:num_requests_waiting"][0].value == 4
        cache = {s.labels["engine"]: s for s in metrics["vllm:cache_config_info"]}
        assert set(cache) == {"0", "1"}, "one per DP group, as vLLM has one per engine core"
        assert all(
            s.value == 1 and s.labels["block_size"] == "16" and s.labels["num_gpu_blocks"] == str(stats.num_blocks) for s in cache.values()
        )
        wait_until(lambda: all_blocks_free(served), what="every dropped request's blocks to be freed")

        loads_before = sample(metrics, "vllm:lora_adapter_load_seconds", "vllm:lora_adapter_load_seconds_count")
        completion = client.completions.create(model=STANDBY, prompt="w1 w2 w3 w40 w41", max_tokens=5, temperature=0)
        assert completion.usage.completion_tokens == 5
        after = scrape(url)
        assert residency(after)[STANDBY] == ("gpu", "false", rank), "its first request loaded it"
        assert sample(after, "vllm:lora_adapter_load_seconds", "vllm:lora_adapter_load_seconds_count") == loads_before + 1
        assert after["vllm:num_gpu_loaded_lora_adapters"][0].value == 4
    finally:
        served.agent.unload(STANDBY)
        served.agent.unload(PINNED)
    gone = scrape(url)
    assert set(residency(gone)) == set(ADAPTERS)
    assert gone["vllm:num_gpu_loaded_lora_adapters"][0].value == 2


def test_per_adapter_request_metrics_count_each_adapters_own_requests(served, client):
    """Requests, prompt and generated tokens, time to first token and inter-token latency, per
    adapter; an unloaded adapter's series go with it."""
    url = f"{served.base_url}/metrics"
    name = "gm-counted"
    load(served, name, seed=602)
    try:
        base_before = scrape(url)
        usages = [client.completions.create(model=name, prompt=p, max_tokens=4, temperature=0).usage for p in ("w1 w2 w3", "w7 w8", "w20")]
        assert [u.completion_tokens for u in usages] == [4, 4, 4]
        usage = client.completions.create(model=BASE, prompt="w5 w6", max_tokens=3, temperature=0).usage
        metrics = scrape(url)
        family = "lorafleet_agent_adapter_requests"
        assert sample(metrics, family, f"{family}_total", adapter=name) == 3
        family = "lorafleet_agent_adapter_prompt_tokens"
        assert sample(metrics, family, f"{family}_total", adapter=name) == sum(u.prompt_tokens for u in usages)
        family = "lorafleet_agent_adapter_generated_tokens"
        assert sample(metrics, family, f"{family}_total", adapter=name) == 12
        family = "lorafleet_agent_adapter_time_to_first_token_seconds"
        assert sample(metrics, family, f"{family}_count", adapter=name) == 3
        assert sample(metrics, family, f"{family}_sum", adapter=name) > 0
        family = "lorafleet_agent_adapter_inter_token_latency_seconds"
        assert sample(metrics, family, f"{family}_count", adapter=name) == 9, "three gaps in each of the three requests"
        family = "lorafleet_agent_adapter_generated_tokens"
        base_tokens = sample(metrics, family, f"{family}_total", adapter=BASE_LABEL) - sample(
            base_before, family, f"{family}_total", adapter=BASE_LABEL
        )
        assert base_tokens == usage.completion_tokens == 3
    finally:
        served.agent.unload(name)
    after = scrape(url)
    assert not [s for s in after["lorafleet_agent_adapter_requests"] if s.labels.get("adapter") == name], "its series are removed"


def test_residency_rank_is_each_adapters_lora_rank(served):
    """`rank` of vllm:lora_adapter_loaded is `r` of the adapter's own config."""
    path = make_adapter(served.agent.config.sources.adapter_roots[0] / "gm-rank4", seed=603, rank=4)
    assert served.agent.load("gm-rank4", path.as_uri(), standby=True).ok
    try:
        assert residency(scrape(f"{served.base_url}/metrics"))["gm-rank4"] == ("cpu", "false", "4")
    finally:
        served.agent.unload("gm-rank4")
