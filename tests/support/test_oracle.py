"""Self-checks of the numeric reference (tests/reference.py). No engine needed.

These prove the oracle is an oracle: adapters really change the output (so the engine
equivalence tests can fail), PEFT's reading of the files agrees with an independent hand merge,
the files have the format the engine's loader is written against, and each bad-adapter factory
produces the defect it claims.
"""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from safetensors import safe_open

from tests import reference as R

TOKENS = [1, 5, 249, 0, 17, 33, 100]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("reference")


@pytest.fixture(scope="module")
def llama(work):
    return R.make_tiny_model(work / "llama", "llama", max_shard_size="40KB")


@pytest.fixture(scope="module")
def qwen3(work):
    return R.make_tiny_model(work / "qwen3", "qwen3", tie_word_embeddings=True, num_key_value_heads=1)


def test_tiny_model_files(llama, qwen3):
    files = R.checkpoint_files(llama)
    assert len(files) >= 2, files
    assert (llama / "model.safetensors.index.json").is_file()
    keys = set()
    for f in files:
        with safe_open(str(f), "pt") as fh:
            keys |= set(fh.keys())
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    cfg = R.model_config(llama)
    assert cfg["vocab_size"] % 4 != 0 and cfg["tie_word_embeddings"] is False

    qcfg = R.model_config(qwen3)
    assert qcfg["model_type"] == "qwen3" and qcfg["head_dim"] * qcfg["num_attention_heads"] != qcfg["hidden_size"]
    assert qcfg["num_key_value_heads"] == 1 and qcfg["tie_word_embeddings"] is True
    (qfile,) = R.checkpoint_files(qwen3)
    with safe_open(str(qfile), "pt") as fh:
        qkeys = set(fh.keys())
        assert "lm_head.weight" not in qkeys  # tied: only the embedding is stored
        assert "model.layers.0.self_attn.q_norm.weight" in qkeys
        assert fh.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [4 * 24, 64]
        assert fh.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [24, 64]
        assert fh.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def test_models_are_deterministic(work, llama):
    again = R.make_tiny_model(work / "llama-again", "llama", max_shard_size="40KB")
    for a, b in zip(R.checkpoint_files(llama), R.checkpoint_files(again), strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_base_logits_not_degenerate(llama, qwen3):
    for model in (llama, qwen3):
        (logits,) = R.reference_logits(model, [(TOKENS, None)])
        assert logits.shape == (len(TOKENS), 250) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        assert 0.2 < logits.std().item() < 10, logits.std()


def test_adapter_file_format(llama, work):
    a = R.make_adapter(llama, work / "fmt", r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"])
    tensors = R.adapter_tensors(a)
    expected = {R.lora_key(layer, m, w) for layer in (0, 1) for m in ("q_proj", "down_proj") for w in "AB"}
    assert set(tensors) == expected
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert tensors[R.lora_key(0, "q_proj", "A")].shape == (8, 64)
    assert tensors[R.lora_key(0, "q_proj", "B")].shape == (64, 8)
    assert tensors[R.lora_key(1, "down_proj", "A")].shape == (8, 128)
    assert tensors[R.lora_key(1, "down_proj", "B")].shape == (64, 8)
    for t in tensors.values():
        assert t.dtype == torch.float32
        assert (t != 0).float().mean() > 0.99  # B was overwritten: PEFT would leave it all zero
    cfg = R.adapter_config(a)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert sorted(cfg["target_modules"]) == ["down_proj", "q_proj"]
    assert cfg["use_rslora"] is False and cfg["use_dora"] is False and cfg["bias"] == "none"
    assert cfg["modules_to_save"] is None and cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}
    assert cfg["base_model_name_or_path"] == str(llama)


def test_disabled_adapter_equals_base_and_adapter_changes_output(llama, work):
    a = R.make_adapter(llama, work / "all", target_modules="all-linear")
    base, lora = R.reference_logits(llama, [(TOKENS, None), (TOKENS, "a")], {"a": a})
    disabled = R.peft_disabled_logits(llama, a, TOKENS)
    torch.testing.assert_close(disabled, base, atol=1e-6, rtol=1e-6)
    assert (lora - base).abs().max() > 0.1


@pytest.mark.parametrize("module", R.ALL_MODULES)
def test_each_module_matters(llama, work, module):
    """A LoRA on any single module moves the logits far beyond the 1e-4 tolerance, so the
    equivalence tests catch a module the engine drops or mis-slices."""
    a = R.make_adapter(llama, work / f"only-{module}", r=4, lora_alpha=8, target_modules=[module])
    base, lora = R.reference_logits(llama, [(TOKENS, None), (TOKENS, "a")], {"a": a})
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
        dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
             rank_pattern={"down_proj": 16}, alpha_pattern={"q_proj": 2}),
        dict(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"], layers_to_transform=[1]),
    ],
    ids=["rslora-all-linear", "patterns-regex", "rslora-patterns", "layers_to_transform"],
)
def test_peft_agrees_with_hand_merge(llama, qwen3, work, kwargs, request):
    """PEFT's reading of the adapter equals W += scale·B·A merged by hand from the files with the
    scale rule of DESIGN.md §3; a config option PEFT and the rule disagree on would show here."""
    for model in (llama, qwen3):
        a = R.make_adapter(model, work / f"merge-{model.name}-{request.node.callspec.id}", **kwargs)
        (lora,) = R.reference_logits(model, [(TOKENS, "a")], {"a": a})
        manual = R.manual_lora_logits(model, a, TOKENS)
        torch.testing.assert_close(lora, manual, atol=2e-5, rtol=2e-5)


def test_patterns_are_applied(llama, work):
    cfg = R.adapter_config(
        R.make_adapter(
            llama, work / "pat", target_modules=r".*\.(k_proj|o_proj)$",
            rank_pattern={"o_proj": 4, r"layers\.1\.self_attn\.k_proj": 12}, alpha_pattern={"k_proj": 3},
        )
    )
    tensors = R.adapter_tensors(work / "pat")
    assert tensors[R.lora_key(0, "o_proj", "A")].shape[0] == 4
    assert tensors[R.lora_key(0, "k_proj", "A")].shape[0] == 8
    assert tensors[R.lora_key(1, "k_proj", "A")].shape[0] == 12
    assert cfg["target_modules"] == r".*\.(k_proj|o_proj)$"
    assert cfg["alpha_pattern"] == {"k_proj": 3}


def test_rslora_changes_the_output(llama, work):
    """Same weights, rsLoRA on vs off: the outputs differ by far more than the tolerance."""
    kw = dict(r=16, lora_alpha=16, target_modules=["v_proj", "down_proj"])
    plain = R.make_adapter(llama, work / "rs-off", seed=3, **kw)
    rs = R.make_adapter(llama, work / "rs-on", seed=3, use_rslora=True, **kw)
    assert R.adapter_tensors(plain).keys() == R.adapter_tensors(rs).keys()
    a, b = R.reference_logits(llama, [(TOKENS, "p"), (TOKENS, "r")], {"p": plain, "r": rs})
    assert (a - b).abs().max() > 1e-2


def test_reference_cache_sees_rewritten_files(llama, work):
    path = work / "rewrite"
    R.make_adapter(llama, path, seed=1, target_modules=["q_proj"])
    (first,) = R.reference_logits(llama, [(TOKENS, "a")], {"a": path})
    R.make_adapter(llama, path, seed=2, target_modules=["q_proj"])
    (second,) = R.reference_logits(llama, [(TOKENS, "a")], {"a": path})
    assert (first - second).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Bad adapters: each factory produces the defect it names
# ---------------------------------------------------------------------------------------------


def _readable(path) -> bool:
    try:
        with safe_open(str(path), "pt") as fh:
            for k in fh.keys():
                fh.get_tensor(k)
        return True
    except Exception:
        return False


@pytest.mark.parametrize("case", sorted(R.BAD_ADAPTERS))
def test_bad_adapter_factories(llama, work, case):
    factory, phrase = R.BAD_ADAPTERS[case]
    d = factory(llama, work / f"bad-{case}")
    files = {p.name for p in d.iterdir()}
    weights = d / R.ADAPTER_WEIGHTS
    cfg = R.adapter_config(d) if (d / R.ADAPTER_CONFIG).exists() else None
    if case == "dora":
        assert cfg["use_dora"] is True
        assert any(k.endswith("lora_magnitude_vector") for k in R.adapter_tensors(d))
    elif case == "modules_to_save":
        assert cfg["modules_to_save"] == ["lm_head"]
        assert "base_model.model.lm_head.weight" in R.adapter_tensors(d)
    elif case in ("bias_all", "bias_lora_only"):
        assert cfg["bias"] == case.removeprefix("bias_")
    elif case == "lora_bias":
        assert cfg["lora_bias"] is True
        assert any(k.endswith("lora_B.bias") for k in R.adapter_tensors(d))
    elif case == "rank_too_big":
        assert cfg["r"] == 32 and R.adapter_tensors(d)[R.lora_key(0, "q_proj", "A")].shape[0] == 32
    elif case == "rank_pattern_too_big":
        assert cfg["r"] == 4 and cfg["rank_pattern"] == {"v_proj": 32}
        assert R.adapter_tensors(d)[R.lora_key(0, "v_proj", "A")].shape[0] == 32
    elif case == "other_base":
        assert cfg["base_model_name_or_path"] == str(llama)
        assert R.adapter_tensors(d)[R.lora_key(0, "q_proj", "A")].shape == (4, 96)
    elif case == "unknown_module_name":
        assert any(".c_attn." in k for k in R.adapter_tensors(d)) and "c_attn" in cfg["target_modules"]
    elif case == "unknown_module_layer":
        assert any(".layers.7." in k for k in R.adapter_tensors(d))
    elif case == "missing_config":
        assert R.ADAPTER_CONFIG not in files and weights.is_file()
    elif case == "missing_weights":
        assert R.ADAPTER_WEIGHTS not in files and cfg is not None
    elif case.startswith(("truncated", "corrupt")):
        assert weights.is_file() and not _readable(weights)
    elif case in ("nan", "inf", "neg_inf"):
        bad = [k for k, t in R.adapter_tensors(d).items() if not torch.isfinite(t).all()]
        assert len(bad) == 1, bad
    elif case == "pickle_only":
        assert R.ADAPTER_WEIGHTS not in files and "adapter_model.bin" in files
        assert set(torch.load(d / "adapter_model.bin", weights_only=True)) >= {R.lora_key(0, "q_proj", "A")}
    else:
        pytest.fail(f"no self-check for {case}")
    assert phrase == phrase.lower()


def test_pickle_decoys_and_open_watcher(llama, work):
    d, decoys, marker = R.make_adapter_with_pickle_decoys(llama, work / "decoys", target_modules=["q_proj"])
    assert _readable(d / R.ADAPTER_WEIGHTS)
    assert {p.name for p in decoys} == {"adapter_model.bin", "adapter_model.pt"}
    # The .bin is not loadable at all; the .pt would run code if unpickled without weights_only.
    with pytest.raises(Exception):
        torch.load(decoys[0], weights_only=False)
    with pytest.raises(Exception):
        torch.load(decoys[1], weights_only=True)
    assert not marker.exists()

    # The watcher sees opens by anyone and stays silent otherwise (it can fail).
    with R.FileOpenWatcher(decoys) as w:
        os.stat(decoys[0])
        os.listdir(d)
    assert not w.opened
    with R.FileOpenWatcher(decoys) as w, open(decoys[1], "rb") as fh:
        fh.read(1)
    assert w.opened == {decoys[1]}


def test_corrupt_header_length_really_is_huge(llama, work):
    d = R.make_corrupt_header_adapter(llama, work / "huge", how="huge_length")
    (n,) = struct.unpack("<Q", (d / R.ADAPTER_WEIGHTS).read_bytes()[:8])
    assert n > (d / R.ADAPTER_WEIGHTS).stat().st_size


def test_config_is_json(llama, work):
    d = R.make_adapter(llama, work / "json", use_rslora=True, r=4, lora_alpha=8)
    cfg = json.loads((d / R.ADAPTER_CONFIG).read_text())
    assert cfg["use_rslora"] is True and math.isclose(cfg["lora_alpha"] / math.sqrt(cfg["r"]), 4.0)
