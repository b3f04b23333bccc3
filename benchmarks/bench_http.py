"""The same generation requests through the OpenAI-compatible HTTP API (streaming) and through
gRPC `Generate` (streaming), printed side by side from one run against one agent process
(`lorafleet-agent serve --tp 2 --dp 2 --http-listen`, CPU): the HTTP path's cost over gRPC,
whose target is at most 1.1x.

(a) one request alone: time to the first token and to the last, median over the repeats;
(b) a burst of concurrent requests (one client thread each): wall time until all have ended.

HTTP is measured twice: with the official `openai` client (what users run; it builds a pydantic
object per chunk) and with a plain reader of the event stream (`http.client`), which leaves only
the server's cost. Every path sends token ids (the same prompt, adapter, greedy, `--tokens` new
tokens) and the agent decodes text (the model directory has a tokenizer). The agent runs in its
own process, as deployed, so the clients do not share its interpreter. The model matches
benchmarks/bench_engine.py (hidden 1024, 4 layers).
Run: `. scripts/bootstrap.sh && python benchmarks/bench_http.py [--repeats N] [--tokens N]`.
CPU timings on a shared machine are noisy: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.synthetic import BENCHMARK_MODEL, write_adapter, write_model

SHAPE = BENCHMARK_MODEL
PROMPT = [17, 4000, 251, 9, 8100, 33, 1024, 77]
ADAPTER = "bench"
Sample = tuple[float, float, int]  # time to the first token, to the last, tokens


def write_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer over the whole vocabulary, so every path decodes text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SHAPE.vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))


def start_agent(root: Path, model: Path, concurrency: int) -> tuple[subprocess.Popen[bytes], int, int]:
    """`lorafleet-agent serve` with gRPC and HTTP on free ports; returns it and both ports."""
    log = root / "agent.log"
    command = [
        str(Path(sys.executable).parent / "lorafleet-agent"),
        "--log-level",
        "INFO",
        "serve",
        "--model",
        str(model),
        "--tp",
        "2",
        "--dp",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--adapter-root",
        str(root / "adapters"),
        "--max-num-seqs",
        str(concurrency),
        "--max-inference-calls",
        str(concurrency),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = log.read_text()
        grpc_port = re.search(r"NodeAgent on \S+ \(port (\d+)\)", text)
        http_port = re.search(r"HTTP API on \S+ \(port (\d+)\)", text)
        if grpc_port and http_port:
            return process, int(grpc_port.group(1)), int(http_port.group(1))
        if process.poll() is not None:
            raise RuntimeError(f"the agent exited with {process.returncode}:\n{text}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the agent did not start:\n{log.read_text()}")


def grpc_stream(stub: agent_pb2_grpc.NodeAgentStub, tokens: int) -> Sample:
    start = time.perf_counter()
    first, count = 0.0, 0
    for _ in stub.Generate(pb.GenerateRequest(token_ids=PROMPT, adapter=ADAPTER, max_new_tokens=tokens), timeout=600):
        count += 1
        first = first or time.perf_counter() - start
    return first, time.perf_counter() - start, count


def openai_stream(client: openai.OpenAI, tokens: int) -> Sample:
    start = time.perf_counter()
    first, count = 0.0, 0
    for chunk in client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True):
        if chunk.choices:
            count += 1
            first = first or time.perf_counter() - start
    return first, time.perf_counter() - start, count


def sse_stream(port: int, tokens: int) -> Sample:
    """The same request read as plain server-sent events (one JSON parse per event, no model)."""
    body = json.dumps({"model": ADAPTER, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True})
    start = time.perf_counter()
    first, count = 0.0, 0
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        for line in response:
            if line.startswith(b"data: {"):
                json.loads(line[6:])
                count += 1
                first = first or time.perf_counter() - start
    finally:
        connection.close()
    return first, time.perf_counter() - start, count


def burst(call: Callable[[], Sample], concurrency: int) -> float:
    """Wall time of `concurrency` requests started together, one thread each."""
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda _: call(), range(concurrency)))
        elapsed = time.perf_counter() - start
    assert len({count for _, _, count in results}) == 1, "every request gives the same number of tokens"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_model(root / "model", SHAPE)
        write_tokenizer(model)
        adapter = write_adapter(root / "adapters" / ADAPTER, SHAPE, rank=16, alpha=32.0, seed=1)
        process, grpc_port, http_port = start_agent(root, model, args.concurrency)
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        try:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            assert stub.LoadAdapter(pb.LoadAdapterRequest(name=ADAPTER, source_uri=adapter.as_uri()), timeout=120).success
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-", max_retries=0, timeout=600)
            paths: dict[str, Callable[[], Sample]] = {
                "gRPC": lambda: grpc_stream(stub, args.tokens),
                "HTTP openai": lambda: openai_stream(client, args.tokens),
                "HTTP SSE": lambda: sse_stream(http_port, args.tokens),
            }
            for call in paths.values():  # warm-up: every path once, and the engine's first steps
                call()
            alone: dict[str, list[Sample]] = {name: [] for name in paths}
            bursts: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats):  # interleaved, so drift on the machine hits every path alike
                for name, call in paths.items():
                    alone[name].append(call())
                for name, call in paths.items():
                    bursts[name].append(burst(call, args.concurrency))
        finally:
            channel.close()
            process.terminate()
            process.wait(timeout=60)

    def median(name: str, index: int) -> float:
        return statistics.median(sample[index] for sample in alone[name])

    rows = {
        "one stream: first token": {name: median(name, 0) for name in paths},
        "one stream: last token": {name: median(name, 1) for name in paths},
        f"{args.concurrency} concurrent streams: all done": {name: statistics.median(bursts[name]) for name in paths},
    }
    print(
        f"tp=2 dp=2 CPU, hidden {SHAPE.hidden_size}, {SHAPE.num_layers} layers, adapter rank 16, "
        f"prompt {len(PROMPT)} tokens, {args.tokens} new tokens (greedy), median of {args.repeats}"
    )
    names = list(paths)
    print(f"  {'':<34}" + "".join(f"{name:>13}" for name in names) + "".join(f"{name + '/gRPC':>18}" for name in names[1:]))
    for what, figures in rows.items():
        print(
            f"  {what:<34}"
            + "".join(f"{figures[name] * 1e3:>10.1f} ms" for name in names)
            + "".join(f"{figures[name] / figures['gRPC']:>17.3f}x" for name in names[1:])
        )


if __name__ == "__main__":
    main()
