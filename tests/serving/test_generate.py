"""Generation end to end (docs/serving.md): real rank processes (gloo) run the scheduler's steps
over their paged KV caches, and concurrent requests share steps.

The oracle is `transformers` + `peft` `generate` with its own KV cache, fp32, one request at a
time: greedy outputs must equal it token for token, for many concurrent requests of different
adapters (more than `max_loras_per_batch`, so some wait for a slot), prompt lengths (chunked
prefill over a small token budget, block boundaries) and output lengths, base-only requests
among them. One engine per topology (tp 1/2/4, dp 1/2, KV-head replication, S-LoRA mode,
prefix caching on and off) serves the shared tests; other engines have a KV budget so small
that sequences are preempted (and recomputed), a short waiting queue, or a MoE model with EP.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.agent.helpers import wait_until
from tests.engine.helpers import Artifacts, draw_tokens, engine_api
from tests.support.models import load_base_model, model_config, quietly

MODEL = "llama"  # kv heads 2, untied, multi-file checkpoint
ADAPTERS = ["all_list", "qv_r2", "down_r16", "rslora_all_linear", "patterns_regex"]  # 5 > 4 slots
BLOCK_SIZE = 4


@dataclass(frozen=True)
class Topo:
    tp: int
    dp: int
    prefix_caching: bool
    model: str = MODEL
    fully_sharded: bool = False

    @property
    def id(self) -> str:
        mode = "-fs" if self.fully_sharded else ""
        return f"tp{self.tp}-dp{self.dp}-{self.model}{mode}-{'prefix' if self.prefix_caching else 'noprefix'}"


TOPOLOGIES = [
    Topo(2, 2, prefix_caching=True),  # attention-TP 1, two DP groups
    Topo(2, 1, prefix_caching=False),
    # attention-TP 2 with its one KV head replicated on both ranks, two DP groups, S-LoRA mode
    Topo(4, 2, prefix_caching=True, model="llama_kv1_tied", fully_sharded=True),
    Topo(1, 1, prefix_caching=False, model="qwen3_tied"),  # q/k norms, head_dim 24 * 4 heads != hidden
    Topo(4, 1, prefix_caching=False, model="llama_kv1_tied"),  # attention-TP 4, the KV head replicated x4
]


@dataclass(frozen=True)
class Req:
    tokens: list[int]
    adapter: str | None
    max_tokens: int


def requests(vocab: int) -> list[Req]:
    """Ten requests: five adapters and base, prompts of 1..13 tokens, outputs of 2..11; two share
    a prompt prefix of two whole blocks with the same adapter (prefix cache hits) and one shares
    it with another adapter (never a hit)."""
    shared = draw_tokens(900, 2 * BLOCK_SIZE, vocab)
    items: list[tuple[list[int], str | None, int]] = [
        (draw_tokens(1, 7, vocab), "all_list", 9),
        (draw_tokens(2, 3, vocab), None, 5),
        (draw_tokens(3, 13, vocab), "qv_r2", 11),
        (draw_tokens(4, 1, vocab), "down_r16", 4),
        (draw_tokens(5, 5, vocab), None, 8),
        (draw_tokens(6, 9, vocab), "rslora_all_linear", 2),
        (draw_tokens(7, 4, vocab), "patterns_regex", 7),
        (shared + draw_tokens(8, 3, vocab), "all_list", 6),
        (shared + draw_tokens(9, 2, vocab), "all_list", 10),
        (shared + draw_tokens(10, 3, vocab), "qv_r2", 3),
    ]
    return [Req(tokens, adapter, n) for tokens, adapter, n in items]


# -- the oracle ------------------------------------------------------------------------------------

_MODELS: dict[tuple[str, str | None], Any] = {}


@quietly
def _hf_model(model_dir: Path, adapter_dir: Path | None) -> Any:
    from peft import PeftModel

    key = (str(model_dir), None if adapter_dir is None else str(adapter_dir))
    if key not in _MODELS:
        base = load_base_model(model_dir)
        _MODELS[key] = base if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).eval()
    return _MODELS[key]


@torch.no_grad()
def reference_generate(model_dir: Path, adapters: dict[str, Path], req: Req) -> list[int]:
    """Greedy `generate` (its own KV cache, fp32) of exactly `max_tokens` new tokens."""
    model = _hf_model(model_dir, None if req.adapter is None else adapters[req.adapter])
    out = model.generate(
        input_ids=torch.tensor([req.tokens]),
        attention_mask=torch.ones(1, len(req.tokens), dtype=torch.long),
        max_new_tokens=req.max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    new: list[int] = out[0, len(req.tokens) :].tolist()
    assert len(new) == req.max_tokens, "premise: the oracle generates max_tokens tokens"
    return new


# -- engines ---------------------------------------------------------------------------------------


@dataclass
class Served:
    engine: Any
    model_dir: Path
    adapters: dict[str, Path]
    vocab: int

    def generate(self, reqs: list[Req], **sampling: Any) -> list[list[int]]:
        """Submit every request at once, then collect each one's tokens."""
        api = engine_api()
        handles = [self.engine.submit(r.tokens, r.adapter, api.SamplingParams(max_tokens=r.max_tokens, **sampling)) for r in reqs]
        out = []
        for handle in handles:
            steps = list(handle.tokens())
            assert steps[-1].finish == api.FinishReason.LENGTH and all(s.finish is None for s in steps[:-1])
            out.append([s.token_id for s in steps])
        return out

    def assert_all_blocks_free(self) -> None:
        stats = self.engine.serving_stats()
        assert stats.running == 0 and stats.waiting == 0, stats
        assert stats.free_blocks == (stats.num_blocks,) * len(stats.free_blocks), stats


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Artifacts:
    return Artifacts(tmp_path_factory.mktemp("serving-artifacts"))


def _engine(artifacts: Artifacts, tp: int, dp: int, model: str = MODEL, fully_sharded: bool = False, **serving: Any) -> Iterator[Served]:
    api = engine_api()
    model_dir = artifacts.model(model)
    adapters = {name: artifacts.adapter(model, "standard", name) for name in ADAPTERS}
    topology = api.Topology(tp_size=tp, dp_size=dp, fully_sharded_loras=fully_sharded)
    config = api.EngineConfig(
        model_dir=model_dir,
        topology=topology,
        max_lora_rank=16,
        max_loras_per_batch=4,
        max_loaded_loras=8,
        device="cpu",
        block_size=BLOCK_SIZE,
        **serving,
    )
    with api.Engine(config) as engine:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        yield Served(engine, model_dir, adapters, model_config(model_dir)["vocab_size"])


def generate_on_a_fresh_engine(config: Any, adapters: dict[str, Path], reqs: list[Req]) -> list[list[int]]:
    """Each request's tokens from an engine of `config` with `adapters` loaded, all submitted at
    once; every KV block is checked free afterwards."""
    api = engine_api()
    with api.Engine(config) as engine:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        served = Served(engine, config.model_dir, adapters, model_config(config.model_dir)["vocab_size"])
        got = served.generate(reqs)
        served.assert_all_blocks_free()
    return got


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=[t.id for t in TOPOLOGIES])
def served(request, artifacts) -> Iterator[Served]:
    topo: Topo = request.param
    yield from _engine(
        artifacts,
        topo.tp,
        topo.dp,
        topo.model,
        topo.fully_sharded,
        prefix_caching=topo.prefix_caching,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )


# -- tests -----------------------------------------------------------------------------------------


def test_concurrent_greedy_equals_transformers_peft_generate(served: Served):
    reqs = requests(served.vocab)
    got = served.generate(reqs)
    want = [reference_generate(served.model_dir, served.adapters, r) for r in reqs]
    wrong = [
        f"request {i} (adapter={r.adapter}, prompt {len(r.tokens)}): {g} != {w}"
        for i, (r, g, w) in enumerate(zip(reqs, got, want, strict=True))
        if g != w
    ]
    assert not wrong, "\n".join(wrong)
    assert served.engine.serving_stats().steps > 0
    served.assert_all_blocks_free()


def test_forward_still_matches_after_generation(served: Served):
    from tests import support as R

    seqs = [(draw_tokens(50, 6, served.vocab), "all_list"), (draw_tokens(51, 3, served.vocab), None)]
    api = engine_api()
    got = served.engine.forward([api.SequenceInput(tokens, adapter) for tokens, adapter in seqs])
    want = R.reference_logits(served.model_dir, seqs, served.adapters)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_a_forward_during_generations_shares_their_steps_and_both_match_the_oracles(served: Served):
    """Forward runs through the scheduler: its prompt-only sequences are computed in the same
    steps as running generations (every model run is a Step: one slot decision per step)."""
    from tests import support as R

    api = engine_api()
    reqs = requests(served.vocab)
    handles = [served.engine.submit(r.tokens, r.adapter, api.SamplingParams(max_tokens=r.max_tokens)) for r in reqs]
    seqs = [
        (draw_tokens(52, 21, served.vocab), "qv_r2"),
        (draw_tokens(53, 4, served.vocab), None),
        (draw_tokens(54, 9, served.vocab), "all_list"),
    ]
    got = served.engine.forward([api.SequenceInput(tokens, adapter) for tokens, adapter in seqs])
    generated = [[s.token_id for s in handle.tokens()] for handle in handles]
    for g, w in zip(got, R.reference_logits(served.model_dir, seqs, served.adapters), strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert generated == [reference_generate(served.model_dir, served.adapters, r) for r in reqs]
    assert slot_decisions(served) == served.engine.serving_stats().steps
    served.assert_all_blocks_free()


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(served: Served):
    probe = Req(draw_tokens(60, 5, served.vocab), "qv_r2", 8)
    sampling = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = served.generate([probe], **sampling)[0]
    busy = requests(served.vocab)[:6]
    api = engine_api()
    others = [served.engine.submit(r.tokens, r.adapter, api.SamplingParams(max_tokens=r.max_tokens, temperature=1.0)) for r in busy]
    among = served.generate([probe], **sampling)[0]
    for handle in others:
        list(handle.tokens())
    assert alone == among
    other_seed = served.generate([probe], **{**sampling, "seed": 4321})[0]
    assert other_seed != alone, "premise: the seed matters"
    served.assert_all_blocks_free()


def test_cancel_frees_blocks_at_once(served: Served):
    api = engine_api()
    handle = served.engine.submit(draw_tokens(70, 9, served.vocab), "all_list", api.SamplingParams(max_tokens=200))
    first = next(iter(handle.tokens()))
    assert first.finish is None
    assert handle.cancel()
    served.assert_all_blocks_free()


def _voluntary_switches() -> int:
    """How often this thread has blocked and been woken so far (Linux, /proc/thread-self/status)."""
    status = Path("/proc/thread-self/status").read_text()
    return int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])


def test_a_reader_is_woken_per_token_not_per_poll(served: Served):
    """`tokens()` without a `cancelled` check blocks until the next token, however short
    `poll_s`: its thread is woken a bounded number of times per token (once by the queue, about
    once more for the interpreter lock), never every `poll_s` with nothing to read (at 0.1 ms,
    that would be dozens of times a step)."""
    api = engine_api()
    count = 24
    handle = served.engine.submit(draw_tokens(80, 5, served.vocab), "all_list", api.SamplingParams(max_tokens=count))
    before = _voluntary_switches()
    steps = list(handle.tokens(poll_s=1e-4))
    woken = _voluntary_switches() - before
    assert len(steps) == count and steps[-1].finish == api.FinishReason.LENGTH
    # About twice per token (the queue, then the interpreter lock); a reader woken every `poll_s`
    # would be woken over a thousand times.
    assert woken <= 4 * count, f"the reader was woken {woken} times for {count} tokens"
    served.assert_all_blocks_free()


def test_a_cancel_from_another_thread_ends_a_blocked_reader(served: Served):
    """A reader blocked in `tokens()` (no poll) returns when another thread cancels."""
    api = engine_api()
    handle = served.engine.submit(draw_tokens(81, 5, served.vocab), "qv_r2", api.SamplingParams(max_tokens=200))
    read: list[Any] = []
    first = threading.Event()

    def reader() -> None:
        for step in handle.tokens():
            read.append(step)
            first.set()

    thread = threading.Thread(target=reader)
    thread.start()
    first.wait()
    assert handle.cancel()
    thread.join()
    assert handle.cancelled and 1 <= len(read) < 200 and all(step.finish is None for step in read)
    served.assert_all_blocks_free()


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["noprefix", "prefix"])
def test_a_tiny_kv_budget_preempts_and_keeps_every_token(artifacts, prefix_caching):
    probe = _engine(artifacts, 2, 1)
    block_bytes = next(probe).engine.describe()[0].kv_block_bytes
    probe.close()
    # 8 blocks of 4 tokens per group: any request fits alone (at most 13 + 11 - 1 = 23 tokens),
    # ten at once do not.
    gen = _engine(artifacts, 2, 1, kv_cache_bytes=8 * block_bytes, max_num_seqs=8, max_num_batched_tokens=16, prefix_caching=prefix_caching)
    served = next(gen)
    try:
        assert served.engine.num_kv_blocks == 8
        reqs = requests(served.vocab)
        got = served.generate(reqs)
        want = [reference_generate(served.model_dir, served.adapters, r) for r in reqs]
        assert got == want
        assert served.engine.serving_stats().preemptions > 0, "premise: the budget forces preemption"
        served.assert_all_blocks_free()
    finally:
        gen.close()


def test_a_full_waiting_queue_refuses_with_queue_full(artifacts):
    api = engine_api()
    gen = _engine(artifacts, 1, 1, max_num_seqs=1, max_num_batched_tokens=4, max_waiting=2)
    served = next(gen)
    try:
        tokens = draw_tokens(80, 5, served.vocab)
        running = served.engine.submit(tokens, None, api.SamplingParams(max_tokens=500))
        next(iter(running.tokens()))  # it runs, and holds the one sequence place for 499 more steps
        waiting = [served.engine.submit(tokens, "qv_r2", api.SamplingParams(max_tokens=3)) for _ in range(2)]
        with pytest.raises(api.QueueFull, match="max_waiting 2"):
            served.engine.submit(tokens, None, api.SamplingParams(max_tokens=3))
        with pytest.raises(api.SchedulerError, match="KV cache"):
            served.engine.submit(tokens, None, api.SamplingParams(max_tokens=10**7))
        assert running.cancel()
        assert [len(list(w.tokens())) for w in waiting] == [3, 3]
        served.assert_all_blocks_free()
    finally:
        gen.close()


def test_a_short_request_is_served_while_long_prompts_are_prefilled(artifacts):
    api = engine_api()
    gen = _engine(artifacts, 1, 1, max_num_seqs=4, max_num_batched_tokens=8)
    served = next(gen)
    try:
        # Three prompts of 240 tokens: about 90 steps of prefill at 8 tokens a step, each ending
        # with its one token; the short request comes once the first is being prefilled.
        longs = [served.engine.submit(draw_tokens(90 + i, 240, served.vocab), None, api.SamplingParams(max_tokens=1)) for i in range(3)]
        stats = served.engine.serving_stats
        wait_until(lambda: stats().running > 0, what="the first long prompt to run")
        short = Req(draw_tokens(93, 3, served.vocab), "qv_r2", 3)
        (got,) = served.generate([short])
        assert stats().running == 3, "the short request ended while every long prompt was still being prefilled"
        assert got == reference_generate(served.model_dir, served.adapters, short)
        assert [len(list(long.tokens())) for long in longs] == [1, 1, 1]
        served.assert_all_blocks_free()
    finally:
        gen.close()


@torch.no_grad()
def reference_logprobs(model_dir: Path, adapters: dict[str, Path], req: Req, generated: list[int], top_n: int) -> list[dict[str, Any]]:
    """The `generate` command's logprobs entries from transformers + peft: the log-softmax of
    the logits that predicted each generated token, and the `top_n` most likely (stable order)."""
    model = _hf_model(model_dir, None if req.adapter is None else adapters[req.adapter])
    ids = torch.tensor([req.tokens + generated[:-1]])
    logprobs = model(input_ids=ids).logits[0, len(req.tokens) - 1 :].float().log_softmax(dim=-1)
    values, top_ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    top = [zip(top_ids[i, :top_n].tolist(), values[i, :top_n].tolist(), strict=True) for i in range(len(generated))]
    return [
        {"token": token, "logprob": logprobs[i, token].item(), "top_logprobs": [{"token": t, "logprob": v} for t, v in top[i]]}
        for i, token in enumerate(generated)
    ]


def assert_logprobs_close(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Same tokens in the same order, every logprob within 1e-4."""

    def ids(entries: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
        return [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in entries]

    def values(entries: list[dict[str, Any]]) -> torch.Tensor:
        return torch.tensor([v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))])

    assert ids(got) == ids(want)
    assert torch.allclose(values(got), values(want), atol=1e-4, rtol=0)


def test_the_generate_command_writes_each_requests_tokens_and_logprobs_in_input_order(artifacts, tmp_path):
    import json
    import subprocess
    import sys

    model_dir = artifacts.model(MODEL)
    adapters = {name: artifacts.adapter(MODEL, "standard", name) for name in ADAPTERS[:2]}
    vocab = model_config(model_dir)["vocab_size"]
    reqs = [
        Req(draw_tokens(90, 6, vocab), "all_list", 5),
        Req(draw_tokens(91, 3, vocab), None, 4),
        Req(draw_tokens(92, 9, vocab), "qv_r2", 3),
    ]
    items: list[dict[str, Any]] = [{"tokens": r.tokens, "adapter": r.adapter, "max_tokens": r.max_tokens} for r in reqs]
    stop = reference_generate(model_dir, adapters, reqs[0])[2]
    items[0]["stop_token_ids"] = [stop]
    items[1]["logprobs"] = None  # a request's own field wins over --logprobs
    items[2]["logprobs"] = 5
    (tmp_path / "in.json").write_text(json.dumps(items))
    command = [
        sys.executable,
        "-m",
        "node_agent.cli",
        "generate",
        "--model",
        str(model_dir),
        "--tp",
        "2",
        "--dp",
        "2",
        "--block-size",
        "4",
        "--max-num-batched-tokens",
        "8",
        "--max-num-seqs",
        "4",
        "--logprobs",
        "3",
        "--input",
        str(tmp_path / "in.json"),
        "--output",
        str(tmp_path / "out.json"),
    ]
    command += [f"--adapter={name}={path}" for name, path in adapters.items()]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    want = [reference_generate(model_dir, adapters, r) for r in reqs]
    cut = want[0].index(stop) + 1
    assert [{k: v for k, v in o.items() if k != "logprobs"} for o in out] == [
        {"tokens": want[0][:cut], "finish_reason": "stop"},
        {"tokens": want[1], "finish_reason": "length"},
        {"tokens": want[2], "finish_reason": "length"},
    ]
    assert "logprobs" not in out[1]
    assert_logprobs_close(out[0]["logprobs"], reference_logprobs(model_dir, adapters, reqs[0], want[0][:cut], 3))
    assert_logprobs_close(out[2]["logprobs"], reference_logprobs(model_dir, adapters, reqs[2], want[2], 5))
    (tmp_path / "bad.json").write_text(json.dumps([{"tokens": [1], "adapter": "missing"}]))
    command[command.index(str(tmp_path / "in.json"))] = str(tmp_path / "bad.json")
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "lorafleet-agent: error: an input request names adapter 'missing', which no --adapter gives"
    ]
    command[command.index("--logprobs") + 1] = "21"
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == ["lorafleet-agent: error: --logprobs must be in [0, 20], got 21"]


def test_moe_with_expert_parallelism_generates_as_peft(tmp_path_factory):
    """Qwen3-MoE at tp=4, ep=2, dp=2 (S-LoRA mode): expert LoRA in both PEFT forms and base."""
    from tests import support as R

    api = engine_api()
    root = tmp_path_factory.mktemp("serving-moe")
    model_dir = R.make_tiny_model(root / "model", "qwen3_moe", seed=5)
    fused = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapters = {
        "fused": R.make_adapter(
            model_dir,
            root / "fused",
            seed=1,
            r=4,
            lora_alpha=8,
            a_std=0.3,
            b_std=0.3,
            target_modules=["q_proj", "v_proj"],
            target_parameters=fused,
        ),
        "fused_rslora": R.make_adapter(
            model_dir,
            root / "fused_rslora",
            seed=2,
            r=2,
            lora_alpha=4,
            use_rslora=True,
            a_std=0.3,
            b_std=0.3,
            target_modules=[],
            target_parameters=fused,
        ),
        "per_expert": R.make_per_expert_adapter(model_dir, root / "per_expert", seed=3, r=4, lora_alpha=8),
    }
    vocab = model_config(model_dir)["vocab_size"]
    names: list[str | None] = ["fused", None, "per_expert", "fused_rslora"]
    reqs = [Req(draw_tokens(200 + i, 2 + (5 * i) % 11, vocab), names[i % 4], 3 + (3 * i) % 8) for i in range(8)]
    config = api.EngineConfig(
        model_dir=model_dir,
        topology=api.Topology(4, 2, ep_size=2, fully_sharded_loras=True),
        max_lora_rank=8,
        max_loras_per_batch=3,
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )
    got = generate_on_a_fresh_engine(config, adapters, reqs)
    want = [reference_generate(model_dir, adapters, r) for r in reqs]
    assert got == want


def slot_decisions(served: Served) -> int:
    """Every rank's LoRA slot decisions so far, checked to be the same on all ranks (how many,
    their digest, the slots now); returns how many."""
    replies = served.engine.describe()
    seen = {(r.slot_decisions, r.slot_digest, r.resident) for r in replies}
    assert len(seen) == 1, f"the ranks' slot decisions differ: {[(r.rank, r.slot_decisions, r.resident) for r in replies]}"
    return replies[0].slot_decisions


def test_many_mixed_requests_with_cancellations_leave_every_block_free(served: Served):
    """Requests (every adapter and base, prompts 1..12, outputs 1..6) submitted at once: 1,000 on
    the tp=2 dp=2 engine, 300 on the others. One in seven is cancelled at once and one in eleven
    after its first token. The others each end by length, some equal the oracle; afterwards every
    block is free, and every rank made the same LoRA slot decisions, one per step run."""
    api = engine_api()
    names: list[str | None] = [None, *ADAPTERS]
    count = 1000 if served.engine.config.topology == api.Topology(2, 2) else 300
    decisions_before, steps_before = slot_decisions(served), served.engine.serving_stats().steps
    reqs = [Req(draw_tokens(1000 + i, 1 + i % 12, served.vocab), names[i % len(names)], 1 + i % 6) for i in range(count)]
    handles = [served.engine.submit(r.tokens, r.adapter, api.SamplingParams(max_tokens=r.max_tokens)) for r in reqs]
    for i, handle in enumerate(handles):
        if i % 7 == 3:
            handle.cancel()
    results: dict[int, list[int]] = {}
    for i, handle in enumerate(handles):
        if i % 7 == 3:
            continue
        steps = []
        for step in handle.tokens():
            steps.append(step)
            if i % 11 == 5:
                handle.cancel()
                break
        if i % 11 != 5:
            assert len(steps) == reqs[i].max_tokens and steps[-1].finish == api.FinishReason.LENGTH
            results[i] = [s.token_id for s in steps]
    served.assert_all_blocks_free()
    # Describe waits for a step still in flight (one that ran a sequence cancelled during it).
    decided = slot_decisions(served) - decisions_before
    ran = served.engine.serving_stats().steps - steps_before
    assert ran > 0 and decided == ran
    for i in sorted(results)[::40]:
        assert results[i] == reference_generate(served.model_dir, served.adapters, reqs[i]), f"request {i}"


def test_a_kv_budget_from_device_memory_needs_cuda(artifacts):
    api = engine_api()
    config = api.EngineConfig(model_dir=artifacts.model(MODEL), topology=api.Topology(1, 1), device="cpu", gpu_memory_utilization=0.9)
    with pytest.raises(api.EngineError, match="gpu_memory_utilization needs device cuda, not cpu"):
        api.Engine(config)


def test_a_moe_with_a_shared_expert_at_another_ep_split_generates_as_peft(tmp_path_factory):
    """Qwen2-MoE (a shared expert and its gate beside the routed experts, a dense layer) at tp=2
    ep=2 dp=1 in the default LoRA mode: six concurrent greedy requests equal the oracle."""
    from tests import support as R

    api = engine_api()
    root = tmp_path_factory.mktemp("serving-moe-shared")
    model_dir = R.make_tiny_model(root / "model", "qwen2_moe", seed=6)
    adapters = {
        "everything": R.make_adapter(
            model_dir,
            root / "everything",
            seed=4,
            r=4,
            lora_alpha=8,
            a_std=0.3,
            b_std=0.3,
            target_modules="all-linear",
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
        "shared_only": R.make_adapter(
            model_dir,
            root / "shared_only",
            seed=5,
            r=2,
            lora_alpha=8,
            a_std=0.3,
            b_std=0.3,
            target_modules=["shared_expert_gate", "gate_proj", "down_proj"],
        ),
    }
    vocab = model_config(model_dir)["vocab_size"]
    names: list[str | None] = ["everything", None, "shared_only"]
    reqs = [Req(draw_tokens(300 + i, 2 + (7 * i) % 12, vocab), names[i % 3], 2 + (5 * i) % 9) for i in range(6)]
    config = api.EngineConfig(
        model_dir=model_dir,
        topology=api.Topology(2, 1, ep_size=2),
        max_lora_rank=8,
        max_loras_per_batch=2,
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=6,
        max_num_batched_tokens=16,
    )
    got = generate_on_a_fresh_engine(config, adapters, reqs)
    want = [reference_generate(model_dir, adapters, r) for r in reqs]
    assert got == want
    for adapter in ("everything", "shared_only"):  # premise: each adapter changes some output
        assert any(
            w != reference_generate(model_dir, adapters, Req(r.tokens, None, r.max_tokens))
            for r, w in zip(reqs, want, strict=True)
            if r.adapter == adapter
        ), adapter
