"""Invariant 1 (docs/design.md §3): the sharded engine's logits equal HF transformers + PEFT, fp32,
within 1e-4, for every topology and LoRA mode; plus invariant 6 (base-only sequences get exactly
the base output, and loading adapters never changes it).

One engine per (topology, model, mode) serves a fixed scenario of batches: base only before any
adapter is loaded, a mixed batch (4 adapters + base-only sequences), a batch that forces LRU
eviction into slots previously used by other adapters, a single sequence (with dp=2 the other DP
group is idle, after having served adapters), and a same-name reload with different weights and
targets. The scenario runs once in a module-scoped fixture; each test checks one step, so a
failure names the step and the topology, and lists every sequence's max abs diff.

Coverage of the matrix (see SPECS): tp 1/2/4; dp 1/2 (attn_tp 1, 2, 4); KV-head replication
(kv=1 at attn_tp 2 and 4; kv=2 at attn_tp 4); head_dim*heads != hidden (qwen3); both LoRA modes;
max_lora_rank/tp == 1 in fully-sharded mode; adapter ranks 1..16 below/at max; rsLoRA; rank and
alpha patterns; partial targets (q+v only, down only, layers_to_transform); list, regex and
"all-linear" target_modules; tied embeddings; vocab 250 not divisible by 4; Llama and Qwen3.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import support as R
from tests.engine.helpers import Seq, compare, draw_tokens, engine_api

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Spec:
    model: str
    tp: int
    dp: int
    fully_sharded: bool
    adapter_set: str = "standard"
    max_rank: int = 16

    @property
    def id(self) -> str:
        mode = "fs" if self.fully_sharded else "default"
        return f"tp{self.tp}-dp{self.dp}-{self.model}-{mode}-r{self.max_rank}"


SPECS = [
    Spec("llama", tp=1, dp=1, fully_sharded=False),
    Spec("llama", tp=2, dp=1, fully_sharded=False),
    Spec("llama", tp=2, dp=1, fully_sharded=True),
    Spec("llama", tp=2, dp=2, fully_sharded=False),  # attn_tp 1; idle DP group
    Spec("llama_kv1_tied", tp=4, dp=1, fully_sharded=False),  # kv head replicated x4
    Spec("llama_kv1_tied", tp=4, dp=1, fully_sharded=True, adapter_set="small", max_rank=4),  # max_r/tp == 1
    Spec("llama_kv1_tied", tp=4, dp=2, fully_sharded=False),  # attn_tp 2, kv replicated x2
    Spec("qwen3_tied", tp=2, dp=1, fully_sharded=True),
    Spec("qwen3_tied", tp=4, dp=1, fully_sharded=False),  # kv=2 replicated x2, head_dim 24
    Spec("qwen3_tied", tp=2, dp=2, fully_sharded=True),  # attn_tp 1, idle DP group
    Spec("qwen3_kv1", tp=4, dp=2, fully_sharded=True),  # attn_tp 2, kv replicated x2, 3 layers
    Spec("qwen3_kv1", tp=1, dp=1, fully_sharded=False),
]

# Scenario batches: (adapter name or None, sequence length). At most 4 distinct adapters per batch
# (max_loras_per_batch=4). "evict" needs 3 adapters not resident after "mixed", so the pool must
# evict by LRU and zero the reused slots (layers_subset targets only the last layer).
BATCHES: dict[str, dict[str, list[tuple[str | None, int]]]] = {
    "standard": {
        "base": [(None, 5), (None, 3), (None, 1)],
        "mixed": [
            ("all_list", 5),
            (None, 3),
            ("qv_r2", 7),
            ("down_r16", 1),
            ("rslora_all_linear", 4),
            ("all_list", 2),
            (None, 6),
        ],
        "evict": [("patterns_regex", 6), ("layers_subset", 5), (None, 2), ("rslora_patterns", 3), ("qv_r2", 4)],
        "single_adapter": [("rslora_all_linear", 5)],
        "single_base": [(None, 4)],
        "reload": [("all_list", 5), (None, 3), ("layers_subset", 4)],
    },
    "small": {
        "base": [(None, 5), (None, 3), (None, 1)],
        "mixed": [("all_r4", 5), (None, 3), ("qkv_r1_rs", 7), ("mlp_r2", 1), ("o_r3_layer0", 4), ("all_r4", 2)],
        "evict": [("mlp_r2", 6), (None, 2), ("qkv_r1_rs", 3), ("o_r3_layer0", 4)],
        "single_adapter": [("all_r4", 5)],
        "single_base": [(None, 4)],
        "reload": [("all_r4", 5), (None, 3), ("mlp_r2", 4)],
    },
}
RELOADED = {"standard": "all_list", "small": "all_r4"}  # replaced by "replacement" under the same name
STEPS_IN_ORDER = ["base", "load", "mixed", "evict", "single_adapter", "single_base", "base_again", "reload"]


@dataclass
class Run:
    spec: Spec
    model_dir: Path
    adapters: dict[str, Path]  # name as loaded -> adapter dir (before the reload)
    batches: dict[str, list[Seq]]
    results: dict[str, Any] = field(default_factory=dict)  # step -> list[Tensor] | Exception
    seconds: dict[str, float] = field(default_factory=dict)

    def outputs(self, step: str) -> list[torch.Tensor]:
        result = self.results.get(step)
        if result is None:
            pytest.fail(f"[{self.spec.id}] step {step!r} never ran", pytrace=False)
        if isinstance(result, BaseException):
            pytest.fail(f"[{self.spec.id}] step {step!r} raised {type(result).__name__}: {result}", pytrace=False)
        return result

    def check(self, step: str, adapters: dict[str, Path] | None = None, batch: str | None = None) -> None:
        seqs = self.batches[batch or step]
        got = self.outputs(step)
        want = R.reference_logits(self.model_dir, seqs, adapters if adapters is not None else self.adapters)
        compare(got, want, seqs).fail_if_any(f"[{self.spec.id}] step {step!r} vs transformers+peft")


def _make_batches(spec: Spec, vocab: int) -> dict[str, list[Seq]]:
    batches = {}
    for b, (step, items) in enumerate(BATCHES[spec.adapter_set].items()):
        batches[step] = [Seq(draw_tokens(100 * b + i, length, vocab), name) for i, (name, length) in enumerate(items)]
    return batches


@pytest.fixture(scope="module", params=SPECS, ids=[s.id for s in SPECS])
def run(request, artifacts) -> Run:
    spec: Spec = request.param
    api = engine_api()
    model_dir = artifacts.model(spec.model)
    vocab = R.model_config(model_dir)["vocab_size"]
    all_adapters = artifacts.adapters(spec.model, spec.adapter_set)
    adapters = {k: v for k, v in all_adapters.items() if k != "replacement"}
    result = Run(spec, model_dir, adapters, _make_batches(spec, vocab))
    config = api.EngineConfig(
        model_dir=model_dir,
        topology=api.Topology(tp_size=spec.tp, dp_size=spec.dp, fully_sharded_loras=spec.fully_sharded),
        max_lora_rank=spec.max_rank,
        max_loras_per_batch=4,
        max_loaded_loras=16,
        device="cpu",
    )

    def step(name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            result.results[name] = fn()
        except Exception as exc:
            result.results[name] = exc
        result.seconds[name] = time.monotonic() - t0

    def forward(batch: str):
        return lambda: engine.forward([api.SequenceInput(tokens=s.tokens, adapter=s.adapter) for s in result.batches[batch]])

    def load_all():
        for name, path in adapters.items():
            engine.load_adapter(name, path, pinned=False)
        return True

    def reload():
        replaced = RELOADED[spec.adapter_set]
        engine.unload_adapter(replaced)
        engine.load_adapter(replaced, all_adapters["replacement"], pinned=False)
        return forward("reload")()

    t0 = time.monotonic()
    with api.Engine(config) as engine:
        result.seconds["startup"] = time.monotonic() - t0
        step("base", forward("base"))
        step("load", load_all)
        step("mixed", forward("mixed"))
        step("evict", forward("evict"))
        step("single_adapter", forward("single_adapter"))
        step("single_base", forward("single_base"))
        step("base_again", forward("base"))
        step("reload", reload)
    result.seconds["total"] = time.monotonic() - t0
    print(f"\n[{spec.id}] " + ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items()))
    return result


def test_base_only_before_any_adapter(run: Run):
    run.check("base")


def test_adapters_load(run: Run):
    assert run.outputs("load") is True


def test_mixed_batch_several_adapters_and_base(run: Run):
    run.check("mixed")


def test_lru_eviction_batch(run: Run):
    run.check("evict")


def test_single_sequence_idle_dp_group(run: Run):
    """With dp=2 one DP group gets no sequence: it joins the collectives with zero tokens and
    must not apply LoRA state left from the earlier batches (it served adapters before)."""
    run.check("single_adapter")
    run.check("single_base")


def test_loading_adapters_never_changes_base_output(run: Run):
    """Invariant 6: the same base-only batch before and after adapters were loaded and used is
    bitwise identical (and still equals the reference)."""
    before, after = run.outputs("base"), run.outputs("base_again")
    run.check("base_again", batch="base")
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if not torch.equal(b, a):
            pytest.fail(
                f"[{run.spec.id}] base-only seq {i} changed after loading adapters: max abs diff {(a - b).abs().max().item():.3e}",
                pytrace=False,
            )


def test_same_name_reload_uses_new_weights(run: Run, artifacts):
    """Unload + load under the same name with different weights and fewer targets: no stale
    weights (cache, slot, or modules the new adapter does not target)."""
    replaced = RELOADED[run.spec.adapter_set]
    adapters = dict(run.adapters)
    adapters[replaced] = artifacts.adapter(run.spec.model, run.spec.adapter_set, "replacement")
    run.check("reload", adapters=adapters)


# ---------------------------------------------------------------------------------------------
# Command line: lorafleet-agent forward
# ---------------------------------------------------------------------------------------------


def _agent_cmd() -> list[str]:
    script = Path(sys.executable).with_name("lorafleet-agent")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from node_agent.cli import main; sys.exit(main())"]


def test_cli_forward_matches_reference(artifacts, tmp_path):
    model = "qwen3_tied"
    model_dir = artifacts.model(model)
    vocab = R.model_config(model_dir)["vocab_size"]
    adapters = {n: artifacts.adapter(model, "standard", n) for n in ("all_list", "qv_r2", "rslora_all_linear")}
    seqs = [
        Seq(draw_tokens(900, 5, vocab), "all_list"),
        Seq(draw_tokens(901, 3, vocab), None),
        Seq(draw_tokens(902, 6, vocab), "qv_r2"),
        Seq(draw_tokens(903, 1, vocab), "rslora_all_linear"),
        Seq(draw_tokens(904, 4, vocab), "all_list"),
    ]
    inp = tmp_path / "in.json"
    inp.write_text(json.dumps([{"tokens": s.tokens, "adapter": s.adapter} for s in seqs]))
    out = tmp_path / "out.safetensors"
    cmd = [
        *_agent_cmd(),
        "forward",
        "--model",
        str(model_dir),
        "--tp",
        "2",
        "--dp",
        "2",
        "--fully-sharded-loras",
        "--max-lora-rank",
        "16",
        "--max-loras-per-batch",
        "4",
        "--max-loaded-loras",
        "8",
    ]
    for name, path in adapters.items():
        cmd += ["--adapter", f"{name}={path}"]
    cmd += ["--input", str(inp), "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-4000:]}"
    tensors = load_file(str(out))
    assert set(tensors) == {f"logits.{i}" for i in range(len(seqs))}, sorted(tensors)
    got = [tensors[f"logits.{i}"] for i in range(len(seqs))]
    want = R.reference_logits(model_dir, seqs, adapters)
    compare(got, want, seqs).fail_if_any("lorafleet-agent forward (tp2 dp2 fully sharded) vs transformers+peft")


def test_cli_bad_adapter_exits_nonzero_with_one_line(artifacts, tmp_path):
    model_dir = artifacts.model("llama")
    good = artifacts.adapter("llama", "standard", "all_list")
    bad = R.make_dora_adapter(model_dir, tmp_path / "dora")
    vocab = R.model_config(model_dir)["vocab_size"]
    inp = tmp_path / "in.json"
    inp.write_text(json.dumps([{"tokens": draw_tokens(910, 4, vocab), "adapter": "bad"}, {"tokens": [1, 2], "adapter": None}]))
    out = tmp_path / "out.safetensors"
    cmd = [
        *_agent_cmd(),
        "forward",
        "--model",
        str(model_dir),
        "--tp",
        "2",
        "--dp",
        "1",
        "--adapter",
        f"good={good}",
        "--adapter",
        f"bad={bad}",
        "--input",
        str(inp),
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0, f"bad adapter accepted; stdout:\n{proc.stdout[-2000:]}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"want one line on stderr, got {len(lines)}:\n{proc.stderr[-4000:]}"
    assert "dora" in lines[0].lower(), lines[0]
    assert "Traceback" not in proc.stderr
