"""Shared pieces of the node agent tests: models with a tokenizer, adapters, servers, clients.

Models and adapters are synthetic (node_agent.synthetic: real HF/PEFT file formats, random
weights, no transformers import), so a whole agent starts in seconds. Adapters use a large
alpha so that their effect on greedy decoding is visible.
"""

from __future__ import annotations

import http.server
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Generic, TypeVar

import grpc
import numpy as np
from safetensors.torch import load_file, save_file

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import Engine, EngineBackend, EngineConfig, FaultPlan

SHAPE = SyntheticModel()  # hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 256
ADAPTER_RANK = 8
ADAPTER_ALPHA = 512.0  # scale 64: adapters change greedy outputs clearly
WORDS = [f"w{i}" for i in range(SHAPE.vocab_size)]


def write_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer.json over the model's whole vocabulary ("w0" .. "w255")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))


def start_agent(engine_config: EngineConfig, config: AgentConfig, faults: FaultPlan | None = None) -> tuple[Agent, Engine]:
    """An agent over the builtin engine (with the tests' fault plan, if any), and that engine."""
    backend = EngineBackend.start(engine_config, faults)
    try:
        return Agent(backend, config), backend.engine
    except BaseException:
        backend.close()
        raise


def make_model(directory: Path, tokenizer: bool = True) -> Path:
    model = write_model(directory, SHAPE)
    if tokenizer:
        write_tokenizer(model)
    return model


def make_adapter(directory: Path, seed: int, rank: int = ADAPTER_RANK, **kwargs) -> Path:
    return write_adapter(directory, SHAPE, rank=rank, alpha=ADAPTER_ALPHA, seed=seed, **kwargs)


def make_nan_adapter(directory: Path, seed: int) -> Path:
    """An adapter every rank refuses while reading its shard: a NaN in a replicated tensor (A of a
    column-parallel module). Validation, which reads no tensor data, passes it."""
    adapter = make_adapter(directory, seed)
    weights = load_file(adapter / "adapter_model.safetensors")
    (key,) = [k for k in weights if "layers.0." in k and "q_proj.lora_A" in k]
    weights[key][0, 0] = float("nan")
    save_file(weights, adapter / "adapter_model.safetensors")
    return adapter


def logits(message: pb.Logits) -> np.ndarray:
    return np.frombuffer(message.float32_data, dtype="<f4").reshape(message.num_tokens, message.vocab_size)


def forward(stub: agent_pb2_grpc.NodeAgentStub, *sequences: tuple[list[int], str], **kwargs) -> list[np.ndarray]:
    request = pb.ForwardRequest(sequences=[pb.Sequence(token_ids=t, adapter=a) for t, a in sequences])
    return [logits(item) for item in stub.Forward(request, timeout=60, **kwargs).logits]


def generate(stub: agent_pb2_grpc.NodeAgentStub, tokens: list[int], adapter: str = "", n: int = 8) -> list[int]:
    request = pb.GenerateRequest(token_ids=tokens, adapter=adapter, max_new_tokens=n)
    return [reply.token_id for reply in stub.Generate(request, timeout=120)]


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    """The RpcError a call raises (fails the test if it succeeds)."""
    try:
        call()
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded; an error was expected")


def wait_until(condition: Callable[[], bool], timeout_s: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


P = TypeVar("P")


class Polled(Generic[P]):
    """`probe` called again and again on a thread while in use (a `with` block), as fast as it
    answers: `results` holds each call's result, in order."""

    def __init__(self, probe: Callable[[], P]) -> None:
        self.probe = probe
        self.results: list[P] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Polled[P]:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.append(self.probe())


# -- an HTTP server for http(s) sources ----------------------------------------------------------

# What the test agents' source policies allow (`SourcePolicy(**LOOPBACK_SOURCES)`; `lorafleet-agent
# serve --allow-source http://127.0.0.1:*/ --allow-source-network 127.0.0.0/8`): the loopback servers below.
LOOPBACK_SOURCES: dict[str, tuple[str, ...]] = {
    "allowed_sources": ("http://127.0.0.1:*/", "https://127.0.0.1:*/"),
    "allowed_networks": ("127.0.0.0/8",),
}


class AdapterHTTPServer(http.server.ThreadingHTTPServer):
    """Serves a directory on 127.0.0.1, with test behaviours chosen by the first path segment:

    /files/<p>      the file, with Content-Length
    /stream/<p>     the file without Content-Length (body ends when the connection closes)
    /gate/<p>       waits on `gate` (a threading.Barrier) and then `delay_s` before serving,
                    counting concurrent requests per adapter directory in `concurrent_peak`
    /to-file/<p>    a redirect to file:///etc/hostname
    /to-ftp/<p>     a redirect to ftp://127.0.0.1/<p>
    /moved/<p>      a redirect to /files/<p>
    /fail/<p>       HTTP 500
    /hold/<p>       waits for `release` (bounded: 120 s), counted in `holding`, then serves the file
    """

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.gate: threading.Barrier | None = None
        self.delay_s = 0.0
        self.lock = threading.Lock()
        self.active: dict[str, int] = {}
        self.concurrent_peak: dict[str, int] = {}
        self.requests: list[str] = []
        self.release = threading.Event()
        self.holding = 0

    def url(self, kind: str, relative: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{kind}/{relative}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: AdapterHTTPServer

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        kind, _, relative = self.path.lstrip("/").partition("/")
        path = self.server.root / relative
        redirects = {"to-file": "file:///etc/hostname", "to-ftp": f"ftp://127.0.0.1/{relative}", "moved": f"/files/{relative}"}
        if kind in redirects:
            self.send_response(302)
            self.send_header("Location", redirects[kind])
            self.end_headers()
            return
        if kind == "fail":
            self.send_error(500, "boom")
            return
        if not path.is_file() or ".." in relative:
            self.send_error(404)
            return
        if kind == "hold":
            with self.server.lock:
                self.server.holding += 1
            try:
                self.server.release.wait(120)
            finally:
                with self.server.lock:
                    self.server.holding -= 1
            self._send(path, content_length=True)
            return
        if kind == "gate":
            with self._counted(str(Path(relative).parent)):
                self.server.gate.wait()
                time.sleep(self.server.delay_s)
                self._send(path, content_length=True)
            return
        self._send(path, content_length=(kind != "stream"))

    @contextmanager
    def _counted(self, key: str) -> Iterator[None]:
        with self.server.lock:
            self.server.active[key] = self.server.active.get(key, 0) + 1
            self.server.concurrent_peak[key] = max(self.server.concurrent_peak.get(key, 0), self.server.active[key])
        try:
            yield
        finally:
            with self.server.lock:
                self.server.active[key] -= 1

    def _send(self, path: Path, content_length: bool) -> None:
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if content_length:
            self.send_header("Content-Length", str(len(data)))
        else:
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)


S = TypeVar("S", bound=socketserver.BaseServer)


@contextmanager
def running(server: S) -> Iterator[S]:
    """Serve `server` on a thread for the block's duration, then shut it down and close it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def http_server(root: Path) -> Iterator[AdapterHTTPServer]:
    with running(AdapterHTTPServer(root)) as server:
        yield server
