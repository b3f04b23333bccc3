"""MLA's KV cache under DP attention, printed side by side from one run:

(1) KV bytes per token on one rank, and the largest batch an engine fits in a fixed per-rank KV
    budget, for DeepSeek-V2-Lite and DeepSeek-V3 shapes at tp=8: MLA's latent cache under
    dp = tp (attention-TP 1) against dp = 1 (attention-TP 8), beside the per-head K/V cache MLA
    replaces. The sizes are the engine's own (`kv_cache_layout`), from the configs alone.
(2) The same comparison measured on real engines (tp=4, dp=4 vs dp=1; CPU ranks, gloo) of a tiny
    random DeepSeek-V2 made with transformers: the blocks each engine allocated from the same
    budget, and the largest batch of fixed-length requests each then runs at once, submitted
    together, with no preemption (the engine's counter says so).

Run: `. scripts/bootstrap.sh && python benchmarks/bench_mla_kv.py`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from node_agent.engine import Engine, EngineConfig, SamplingParams, Topology
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.serving.kv_cache import KVCacheLayout, kv_cache_layout

BLOCK_SIZE = 16
# The published configs' MLA and attention fields (no weights needed).
SHAPES: dict[str, dict[str, Any]] = {
    "DeepSeek-V2-Lite": dict(
        model_type="deepseek_v2",
        num_hidden_layers=27,
        num_attention_heads=16,
        hidden_size=2048,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        n_shared_experts=2,
        first_k_dense_replace=1,
        intermediate_size=10944,
        vocab_size=102400,
    ),
    "DeepSeek-V3": dict(
        model_type="deepseek_v3",
        num_hidden_layers=61,
        num_attention_heads=128,
        hidden_size=7168,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        first_k_dense_replace=3,
        n_group=8,
        topk_group=4,
        intermediate_size=18432,
        vocab_size=129280,
    ),
}


def per_head_bytes_per_token(cfg: ModelConfig, attn_tp: int, element: int) -> int:
    """A K/V cache of every head this rank computes (what MLA expanded would need): qk_head_dim of K
    and v_head_dim of V per head and layer."""
    mla = cfg.latent()
    return cfg.num_layers * cfg.num_heads // attn_tp * (mla.qk_head_dim + mla.v_head_dim) * element


def largest_batch(layout: KVCacheLayout, budget: int, dp: int, seq_len: int) -> int:
    """Sequences of `seq_len` tokens an engine holds at once: each DP group fills its own blocks."""
    per_seq = -(-seq_len // layout.block_size)
    return dp * (layout.blocks_for_budget(budget) // per_seq)


def analytic(tp: int, budget: int, seq_len: int) -> None:
    """Part (1): the engine's layouts for the published shapes."""
    print(f"\n(1) one rank's KV cache, tp={tp}, bf16, budget {budget >> 20} MiB per rank, sequences of {seq_len} tokens")
    print(f"{'model':<18}{'cache':<26}{'bytes/token/rank':>18}{'largest batch':>15}")
    for name, raw in SHAPES.items():
        cfg = ModelConfig.from_dict(raw)
        for dp in (tp, 1):
            layout = kv_cache_layout(cfg, Topology(tp, dp), 0, BLOCK_SIZE, torch.bfloat16)
            batch = largest_batch(layout, budget, dp, seq_len)
            print(f"{name:<18}{f'MLA latent, dp={dp}':<26}{layout.bytes_per_token:>18,}{batch:>15,}")
        for dp in (tp, 1):
            per_head = per_head_bytes_per_token(cfg, tp // dp, 2)
            tokens = budget // (per_head * BLOCK_SIZE) * BLOCK_SIZE
            print(f"{name:<18}{f'per-head K/V, dp={dp}':<26}{per_head:>18,}{dp * (tokens // seq_len):>15,}")


def tiny_model(root: Path) -> Path:
    """A tiny random DeepSeek-V2 written by transformers (4 heads, kv_lora_rank 32, 4 layers)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=512,
    )
    DeepseekV2ForCausalLM(config).save_pretrained(root)
    return root


def measured(model: Path, tp: int, budget: int, seq_len: int) -> None:
    """Part (2): real engines, the same per-rank budget, dp = tp against dp = 1."""
    print(
        f"\n(2) measured: tiny DeepSeek-V2 ({model.name}), tp={tp}, fp32, budget {budget >> 10} KiB per rank, "
        f"block {BLOCK_SIZE}, requests of {seq_len} tokens (prompt {seq_len - 1}, one new token)"
    )
    print(f"{'engine':<14}{'bytes/token/rank':>18}{'blocks/group':>14}{'largest batch':>15}{'ran at once':>13}{'preempted':>11}")
    cfg = ModelConfig.from_dir(model)
    for dp in (tp, 1):
        layout = kv_cache_layout(cfg, Topology(tp, dp), 0, BLOCK_SIZE, torch.float32)
        batch = largest_batch(layout, budget, dp, seq_len)
        config = EngineConfig(
            model_dir=model,
            topology=Topology(tp, dp),
            max_lora_rank=4,
            max_loras_per_batch=1,
            kv_cache_bytes=budget,
            block_size=BLOCK_SIZE,
            max_num_seqs=batch,
            max_num_batched_tokens=batch * seq_len,
        )
        with Engine(config) as engine:
            blocks = engine.serving_stats().num_blocks
            handles = [
                engine.submit([(7 * i + j) % 256 for j in range(seq_len - 1)], None, SamplingParams(max_tokens=1)) for i in range(batch)
            ]
            for handle in handles:
                list(handle.tokens())
            stats = engine.serving_stats()
        # One step per request would mean they did not share steps; every request ran in the first.
        print(f"{f'dp={dp}':<14}{layout.bytes_per_token:>18,}{blocks:>14,}{batch:>15,}{stats.steps == 1!s:>13}{stats.preemptions:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=int, default=8192, help="part (1): KV budget per rank")
    parser.add_argument("--seq-len", type=int, default=4096, help="part (1): tokens per sequence")
    parser.add_argument("--tiny-budget-kib", type=int, default=256, help="part (2): KV budget per rank")
    parser.add_argument("--tiny-seq-len", type=int, default=64, help="part (2): tokens per request")
    args = parser.parse_args()
    analytic(8, args.budget_mib << 20, args.seq_len)
    with tempfile.TemporaryDirectory() as root:
        measured(tiny_model(Path(root) / "tiny-deepseek-v2"), 4, args.tiny_budget_kib << 10, args.tiny_seq_len)


if __name__ == "__main__":
    main()
