"""The HTTP API under load against the shared agent: 32 concurrent streams all complete with
each one's own tokens, a dropped stream frees its KV blocks, and the gateway metrics scraped
while requests run and wait say what the engine runs and queues."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from tests.agent.helpers import wait_until
from tests.http.conftest import HEADERS, MAX_NUM_SEQS, all_blocks_free, scrape, scrape_while_busy

CALLS = [("w1 w2 w3", "ad-a"), ("w9 w8", "ad-b"), ("w40 w41 w42 w43", "tiny-llama"), ("w7", "ad-a")]
GATEWAY_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info")


async def stream_text(session: aiohttp.ClientSession, url: str, prompt: str, model: str, max_tokens: int) -> tuple[str, str]:
    """One streamed completion read to its end: its text and finish reason."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, finish = "", ""
    async with session.post(f"{url}/v1/completions", json=body, headers=HEADERS) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = json.loads(line[len(b"data: ") :])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def test_32_concurrent_streams_all_complete_with_their_own_tokens(served, client):
    alone = {call: client.completions.create(model=call[1], prompt=call[0], max_tokens=6, temperature=0).choices[0].text for call in CALLS}
    calls = [CALLS[i % len(CALLS)] for i in range(32)]

    async def together() -> list[tuple[str, str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(stream_text(session, served.base_url, prompt, model, 6) for prompt, model in calls))

    results = asyncio.run(together())
    assert results == [(alone[call], "length") for call in calls]
    wait_until(lambda: all_blocks_free(served), what="every block free")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_dropped_request_cancels_its_sequence_and_frees_its_blocks(served, stream):
    """A client that goes away mid-generation (a stream after its first token, a non-streaming
    request while it runs): the sequence is cancelled in the engine, its blocks freed."""
    before = served.agent.engine.serving_stats().steps

    async def drop() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": "ad-b", "prompt": "w5 w6", "max_tokens": 1000, "stream": stream}
            request = asyncio.create_task(session.post(f"{served.base_url}/v1/completions", json=body, headers=HEADERS))
            if stream:
                response = await request
                assert response.status == 200
                await response.content.readline()  # the first token arrived: the sequence runs
                response.close()  # closes the connection mid-stream
            else:
                await asyncio.to_thread(wait_until, lambda: served.agent.engine.serving_stats().running == 1, what="it to run")
                request.cancel()  # closes the connection before the answer
                with contextlib.suppress(asyncio.CancelledError):
                    await request

    asyncio.run(drop())
    wait_until(lambda: all_blocks_free(served), what="the dropped request's blocks to be freed")
    assert served.agent.engine.serving_stats().steps - before < 999, "the sequence was cancelled, not run to its end"


@pytest.mark.parametrize("endpoint", ["http", "metrics-port"])
def test_gateway_metrics_while_requests_run_and_wait(served, endpoint):
    """MAX_NUM_SEQS requests with ad-a run; four more with ad-b wait for a place. Long requests,
    so nothing finishes while the metrics are read; then every request is dropped."""
    url = f"{served.base_url}/metrics" if endpoint == "http" else f"http://127.0.0.1:{served.server.metrics_port}/metrics"
    idle = scrape(url)
    assert idle["vllm:num_requests_running"][0].value == 0 and idle["vllm:kv_cache_usage_perc"][0].value == 0
    assert idle["vllm:lora_requests_info"][0].labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "4"}

    busy = asyncio.run(scrape_while_busy(served, url))
    metrics = busy.metrics
    assert set(GATEWAY_METRICS) <= set(metrics)
    assert metrics["vllm:num_requests_running"][0].value == MAX_NUM_SEQS
    assert metrics["vllm:num_requests_waiting"][0].value == 4
    assert 0 < busy.kv_before <= metrics["vllm:kv_cache_usage_perc"][0].value <= busy.kv_after < 1
    [info] = metrics["vllm:lora_requests_info"]
    assert info.labels == {"running_lora_adapters": "ad-a", "waiting_lora_adapters": "ad-b", "max_lora": "4"}
    assert info.value > 1.7e9  # a Unix time: gateways keep the newest sample
    assert metrics["lorafleet_engine_steps"][0].value > 0 and "lorafleet_engine_preemptions" in metrics
    assert "lorafleet_agent_inference_requests" in metrics, "lorafleet's own metrics stay beside them"
    wait_until(lambda: all_blocks_free(served), what="every dropped request's blocks to be freed")
