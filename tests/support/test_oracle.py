"""Self-checks of the numeric oracle (tests/support/oracle.py). No engine needed.

These prove the oracle is an oracle: adapters really change the output (so the engine
equivalence tests can fail), and PEFT's reading of the files agrees with an independent hand
merge.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet_dev.synthetic import ALL_MODULES
from tests.support.models import adapter_tensors, make_adapter
from tests.support.oracle import manual_lora_logits, peft_disabled_logits, reference_logits

TOKENS = [1, 5, 249, 0, 17, 33, 100]


def test_base_logits_not_degenerate(llama, qwen3):
    for model in (llama, qwen3):
        (logits,) = reference_logits(model, [(TOKENS, None)])
        assert logits.shape == (len(TOKENS), 250) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        assert 0.2 < logits.std().item() < 10, logits.std()


def test_disabled_adapter_equals_base_and_adapter_changes_output(llama, work):
    a = make_adapter(llama, work / "all", target_modules="all-linear")
    base, lora = reference_logits(llama, [(TOKENS, None), (TOKENS, "a")], {"a": a})
    disabled = peft_disabled_logits(llama, a, TOKENS)
    torch.testing.assert_close(disabled, base, atol=1e-6, rtol=1e-6)
    assert (lora - base).abs().max() > 0.1


@pytest.mark.parametrize("module", ALL_MODULES)
def test_each_module_matters(llama, work, module):
    """A LoRA on any single module moves the logits far beyond the 1e-4 tolerance, so the
    equivalence tests catch a module the engine drops or mis-slices."""
    a = make_adapter(llama, work / f"only-{module}", r=4, lora_alpha=8, target_modules=[module])
    base, lora = reference_logits(llama, [(TOKENS, None), (TOKENS, "a")], {"a": a})
    assert (lora - base).abs().max() > 1e-2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
        dict(
            r=8,
            lora_alpha=16,
            target_modules=r".*\.(k_proj|o_proj|gate_proj|up_proj)$",
            rank_pattern={"o_proj": 4, r"layers\.1\.mlp\.gate_proj": 12},
            alpha_pattern={"k_proj": 3, "up_proj": 40},
        ),
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"down_proj": 16},
            alpha_pattern={"q_proj": 2},
        ),
        dict(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"], layers_to_transform=[1]),
    ],
    ids=["rslora-all-linear", "patterns-regex", "rslora-patterns", "layers_to_transform"],
)
def test_peft_agrees_with_hand_merge(llama, qwen3, work, kwargs, request):
    """PEFT's reading of the adapter equals W += scale·B·A merged by hand from the files with the
    scale rule of docs/design.md §3; a config option PEFT and the rule disagree on would show here."""
    for model in (llama, qwen3):
        a = make_adapter(model, work / f"merge-{model.name}-{request.node.callspec.id}", **kwargs)
        (lora,) = reference_logits(model, [(TOKENS, "a")], {"a": a})
        manual = manual_lora_logits(model, a, TOKENS)
        torch.testing.assert_close(lora, manual, atol=2e-5, rtol=2e-5)


def test_rslora_changes_the_output(llama, work):
    """Same weights, rsLoRA on vs off: the outputs differ by far more than the tolerance."""
    kw = dict(r=16, lora_alpha=16, target_modules=["v_proj", "down_proj"])
    plain = make_adapter(llama, work / "rs-off", seed=3, **kw)
    rs = make_adapter(llama, work / "rs-on", seed=3, use_rslora=True, **kw)
    assert adapter_tensors(plain).keys() == adapter_tensors(rs).keys()
    a, b = reference_logits(llama, [(TOKENS, "p"), (TOKENS, "r")], {"p": plain, "r": rs})
    assert (a - b).abs().max() > 1e-2


def test_reference_cache_sees_rewritten_files(llama, work):
    path = work / "rewrite"
    make_adapter(llama, path, seed=1, target_modules=["q_proj"])
    (first,) = reference_logits(llama, [(TOKENS, "a")], {"a": path})
    make_adapter(llama, path, seed=2, target_modules=["q_proj"])
    (second,) = reference_logits(llama, [(TOKENS, "a")], {"a": path})
    assert (first - second).abs().max() > 1e-3
