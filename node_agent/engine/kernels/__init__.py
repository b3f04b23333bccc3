"""Multi-LoRA shrink/expand kernels (docs/design.md §5, docs/kernels.md).

The interface is deliberately narrow: a `LoraBatch` describing which slot each token uses,
`shrink` (x · Aᵀ per token's slot) and `expand` (add y · Bᵀ · scale into the output), each over
several output slices at once, and `add_fp32`, both in one pass where the torch path serves
fp32. The torch path serves the CPU; triton kernels serve CUDA.
"""

from node_agent.engine.kernels.batch import LoraBatch
from node_agent.engine.kernels.dispatch import SlotViews, add_fp32, expand, shrink

__all__ = ["LoraBatch", "SlotViews", "add_fp32", "expand", "shrink"]
