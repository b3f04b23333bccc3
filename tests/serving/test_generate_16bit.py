"""16-bit serving on the CPU against transformers + PEFT run in the same dtype (docs/serving.md,
"16-bit on the CPU"): real rank processes, bf16 (tp 1 and 2) and fp16.

Two bf16 (or fp16) evaluations of the same network differ by their rounding: transformers
rounds after every matmul and LoRA product, the engine accumulates its layers and LoRA deltas in
fp32 and rounds once per layer output. Neither equals the exact result, so the tolerance is
measured, not guessed: `bound` is twice transformers' own distance, in that dtype, from its fp32
logits on the same sequence (the engine's error is at most transformers', as it rounds less; two
errors each within it differ by at most twice it). Then:

* the engine's logits are within `bound` of transformers' in the same dtype;
* greedy tokens equal transformers' `generate` in the same dtype, except from a step where the
  reference's top two logits are closer than `bound` (there rounding alone may pick either;
  after it the sequences rightly differ, so nothing later is compared).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.helpers import Artifacts, draw_tokens, engine_api
from tests.support.models import load_base_model, model_config, quietly

ADAPTERS = ["all_list", "qv_r2", "rslora_all_linear"]
NEW_TOKENS = 12


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    dtype: str

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}-{self.dtype}"


CASES = [Case("llama", 1, "bfloat16"), Case("qwen3_tied", 2, "bfloat16"), Case("llama", 1, "float16")]


@dataclass
class Served:
    case: Case
    engine: Any
    model_dir: Path
    adapters: dict[str, Path]
    vocab: int


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    return Artifacts(tmp_path_factory.mktemp("artifacts-16bit"))


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def served(request: pytest.FixtureRequest, artifacts: Artifacts) -> Iterator[Served]:
    case: Case = request.param
    api = engine_api()
    model_dir = artifacts.model(case.model)
    adapters = {name: artifacts.adapter(case.model, "standard", name) for name in ADAPTERS}
    config = api.EngineConfig(
        model_dir=model_dir,
        topology=api.Topology(tp_size=case.tp, dp_size=1),
        max_lora_rank=16,
        max_loras_per_batch=4,
        device="cpu",
        dtype=case.dtype,
    )
    with api.Engine(config) as engine:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        yield Served(case, engine, model_dir, adapters, model_config(model_dir)["vocab_size"])


_MODELS: dict[tuple[str, str | None, torch.dtype], Any] = {}


@quietly
def reference_model(model_dir: Path, adapter: Path | None, dtype: torch.dtype) -> Any:
    """transformers (+ PEFT) in `dtype`, adapter weights too (as the engine reads them)."""
    from peft import PeftModel

    key = (str(model_dir), None if adapter is None else str(adapter), dtype)
    if key not in _MODELS:
        base = load_base_model(model_dir)
        model = base if adapter is None else PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).eval()
        _MODELS[key] = model.to(dtype)
    return _MODELS[key]


@torch.no_grad()
def reference_logits(served: Served, tokens: list[int], adapter: str | None, dtype: torch.dtype) -> torch.Tensor:
    model = reference_model(served.model_dir, None if adapter is None else served.adapters[adapter], dtype)
    return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def bound(served: Served, tokens: list[int], adapter: str | None) -> float:
    """Twice transformers' own 16-bit error on `tokens` (see the module's docstring)."""
    dtype = getattr(torch, served.case.dtype)
    exact = reference_logits(served, tokens, adapter, torch.float32)
    return 2 * float((reference_logits(served, tokens, adapter, dtype) - exact).abs().max())


def prompts(vocab: int) -> list[tuple[list[int], str | None]]:
    return [(draw_tokens(60 + i, 3 + 2 * i, vocab), adapter) for i, adapter in enumerate([*ADAPTERS, None])]


def test_logits_are_within_transformers_own_16_bit_error(served: Served) -> None:
    api = engine_api()
    dtype = getattr(torch, served.case.dtype)
    items = prompts(served.vocab)
    got = served.engine.forward([api.SequenceInput(tokens=t, adapter=a) for t, a in items])
    for (tokens, adapter), logits in zip(items, got, strict=True):
        want, allowed = reference_logits(served, tokens, adapter, dtype), bound(served, tokens, adapter)
        worst = float((logits - want).abs().max())
        assert 0 < allowed < 0.25 * float(want.abs().max()), f"premise: a rounding-sized bound, not {allowed}"
        assert worst <= allowed, f"adapter {adapter}: max |engine - transformers| {worst:.4f} over the bound {allowed:.4f}"


@torch.no_grad()
def reference_generate(served: Served, tokens: list[int], adapter: str | None) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens in the served dtype, and each step's top-two logit margin."""
    model = reference_model(served.model_dir, None if adapter is None else served.adapters[adapter], getattr(torch, served.case.dtype))
    ids = torch.tensor([tokens])
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), output_scores=True, return_dict_in_generate=True, **greedy)
    margins = [float(top[0] - top[1]) for top in (score[0].float().topk(2).values for score in out.scores)]
    return out.sequences[0, len(tokens) :].tolist(), margins


def test_greedy_tokens_equal_transformers_where_the_margin_allows(served: Served) -> None:
    api = engine_api()
    items = prompts(served.vocab)
    handles = [served.engine.submit(t, a, api.SamplingParams(max_tokens=NEW_TOKENS)) for t, a in items]
    compared = 0
    for (tokens, adapter), handle in zip(items, handles, strict=True):
        got = [step.token_id for step in handle.tokens()]
        want, margins = reference_generate(served, tokens, adapter)
        allowed = bound(served, tokens, adapter)
        differs = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), None)
        if differs is not None:
            assert margins[differs] < allowed, (
                f"adapter {adapter}: token {differs} is {got[differs]}, transformers {want[differs]}, though its margin "
                f"{margins[differs]:.4f} exceeds the bound {allowed:.4f}\n  engine {got}\n  transformers {want}"
            )
        compared += NEW_TOKENS if differs is None else differs
    assert compared >= len(items) * NEW_TOKENS // 2, f"premise: most tokens compared, not {compared}"
