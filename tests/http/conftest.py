"""One shared agent (tp=2, dp=2, real rank processes) behind its real gRPC server and its real
HTTP API on loopback, both with a bearer token; two adapters loaded for the whole session.

The engine runs at most `MAX_NUM_SEQS` sequences per step, so a burst of requests leaves some
waiting (what the gateway metrics report). Every test leaves no sequence behind.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import EngineConfig, Topology
from node_agent.http_api import HttpApiServer, HttpOptions
from node_agent.server import AgentServer, ServerOptions, create_server
from node_agent.sources import SourcePolicy
from tests.agent.helpers import make_adapter, make_model, wait_until

TOKEN = "http-test-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
BASE = "tiny-llama"
ADAPTERS = ("ad-a", "ad-b")
MAX_NUM_SEQS = 8
# A ChatML-like template over the test vocabulary ("w0" .. "w255"): roles map to words, the
# generation prompt to "w9"; bos/eos come from tokenizer_config.json, as in real models. Words
# are kept apart by spaces: the test tokenizer.json does not list bos/eos as added tokens, so
# only transformers would split "w1w3" (real models' tokenizer.json lists them).
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for message in messages %}"
    "{% if message['role'] == 'system' %}w3{% elif message['role'] == 'user' %}w4{% elif message['role'] == 'assistant' %}w5"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    " {{ message['content'] }} {{ eos_token }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
)


def write_chat_template(model: Path, template: str = CHAT_TEMPLATE) -> None:
    """tokenizer_config.json as transformers saves it: the template and the named special tokens."""
    (model / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "w1",
                "eos_token": "w2",
                "unk_token": "w0",
                "chat_template": template,
            }
        )
    )


@dataclass
class Served:
    agent: Agent
    server: AgentServer
    http: HttpApiServer
    stub: agent_pb2_grpc.NodeAgentStub
    model: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    def client(self, api_key: str = TOKEN, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("http")
    model = make_model(base / BASE)
    write_chat_template(model)
    root = base / "adapters"
    paths = {name: make_adapter(root / name, seed=200 + i) for i, name in enumerate(ADAPTERS)}
    engine_config = EngineConfig(
        model_dir=model, topology=Topology(2, 2), max_loras_per_batch=4, max_loaded_loras=8, max_num_seqs=MAX_NUM_SEQS
    )
    agent = Agent.start(engine_config, AgentConfig(agent_id="http-agent", sources=SourcePolicy(adapter_roots=(root,))))
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0", auth_token=TOKEN, metrics_port=0))
    server.start()
    http = HttpApiServer(
        agent,
        HttpOptions(listen="127.0.0.1:0", auth_token=TOKEN, stop_grace_s=0),
        server.servicer.budgets["inference"],
        server.servicer.closing,
    )
    http.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    for name, path in paths.items():
        reply = stub.LoadAdapter(
            pb.LoadAdapterRequest(name=name, source_uri=path.as_uri()), timeout=60, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        assert reply.success, reply.error_message
    try:
        yield Served(agent, server, http, stub, model)
    finally:
        channel.close()
        http.stop()
        server.stop(grace=0)
        agent.close()


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return served.client()


# -- raw HTTP (status lines, bodies and event streams exactly as sent) ---------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The `data:` fields of a server-sent event stream, in order."""
        return [line[len("data: ") :] for line in self.body.decode().split("\n\n") if line.startswith("data: ")]


def request(served: Served, method: str, path: str, body: object = None, token: str | None = TOKEN, raw: bytes | None = None) -> Answer:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", served.http.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


def grpc_generate(served: Served, **fields) -> list[pb.GenerateResponse]:
    """A gRPC Generate with the test token: every streamed message."""
    return list(served.stub.Generate(pb.GenerateRequest(**fields), timeout=120, metadata=(("authorization", f"Bearer {TOKEN}"),)))


def all_blocks_free(served: Served) -> bool:
    stats = served.agent.engine.serving_stats()
    return stats.running == 0 and stats.waiting == 0 and stats.free_blocks == (stats.num_blocks,) * len(stats.free_blocks)


# -- gateway metrics scraped while requests run and wait ----------------------------------------


def scrape(url: str) -> dict[str, list[Any]]:
    """Every family of the agent's /metrics by name, as prometheus_client's parser reads it."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def kv_usage(served: Served) -> float:
    """The engine's share of KV blocks in use, over every DP group."""
    stats = served.agent.engine.serving_stats()
    total = stats.num_blocks * len(stats.free_blocks)
    return (total - sum(stats.free_blocks)) / total


@dataclass(frozen=True)
class BusyScrape:
    """/metrics scraped while requests ran and waited; the KV usage just before and after."""

    metrics: dict[str, list[Any]]
    kv_before: float
    kv_after: float


async def scrape_while_busy(served: Served, url: str) -> BusyScrape:
    """MAX_NUM_SEQS streams of ad-a running and four of ad-b waiting (long requests: nothing
    finishes meanwhile); `url` scraped while they do, then every stream dropped."""
    async with aiohttp.ClientSession() as session:

        async def hold(model: str) -> None:
            body = {"model": model, "prompt": "w3 w4", "max_tokens": 1000, "stream": True}
            async with session.post(f"{served.base_url}/v1/completions", json=body, headers=HEADERS) as response:
                async for _ in response.content:
                    pass

        stats = served.agent.engine.serving_stats
        running = [asyncio.create_task(hold("ad-a")) for _ in range(MAX_NUM_SEQS)]
        await asyncio.to_thread(wait_until, lambda: stats().running == MAX_NUM_SEQS, what="ad-a's requests running")
        waiting = [asyncio.create_task(hold("ad-b")) for _ in range(4)]
        await asyncio.to_thread(wait_until, lambda: stats().waiting == 4, what="ad-b's requests waiting")
        before = kv_usage(served)
        metrics = await asyncio.to_thread(scrape, url)
        after = kv_usage(served)
        for task in running + waiting:
            task.cancel()
        await asyncio.gather(*running, *waiting, return_exceptions=True)
        return BusyScrape(metrics, before, after)
