"""The model's plain layers: RMS normalisation, and the vocabulary-parallel embedding that is also the LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from node_agent.engine.kernels import dense
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.context import RankSetup
from node_agent.engine.parallel.distributed import all_gather_last_dim, all_reduce
from node_agent.engine.parallel.sharding import MODULE_KINDS, vocab_span


class RMSNorm(nn.Module):
    """RMS normalisation with a learned weight, as transformers computes it."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised `x` in its own dtype."""
        if x.dtype == torch.float32:
            # The same arithmetic in one fused op (nine of these run in every step).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as transformers does (fused: on the
        # CPU a 16-bit step is bound by its op count as fp32's is).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocabulary split over the attention-TP group; `serves_logits`: it is
    (also) the LM head, whose weight gets `dense.pack`'s copy."""

    def __init__(self, setup: RankSetup, serves_logits: bool) -> None:
        super().__init__()
        self.serves_logits = serves_logits
        self.packed: dense.Packed | None = None
        cfg = setup.cfg
        self.span = vocab_span(cfg, setup.topology, setup.rank)
        self.vocab_size = cfg.vocab_size
        self.group = setup.groups.get(MODULE_KINDS["vocab"].group)
        self.weight = nn.Parameter(
            torch.zeros(self.span.width, cfg.hidden_size, dtype=setup.dtype, device=setup.device), requires_grad=False
        )

    def load(self, checkpoint: Checkpoint, key: str) -> None:
        """Read this rank's rows of the embedding (or LM head) `key`."""
        self.weight.copy_(checkpoint.read(key, rows=self.span))
        if self.serves_logits:
            self.packed = dense.pack(self.weight.detach())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of `tokens`: each rank looks up its rows, a sum over the group assembles them."""
        if self.group is None:  # one rank holds every row
            return F.embedding(tokens, self.weight)
        local = tokens - self.span.start
        mine = (local >= 0) & (local < self.span.width)
        out = F.embedding(local.clamp(0, self.span.width - 1), self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(out, self.group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: this rank's vocabulary columns, gathered over the group, padding dropped."""
        if dense.widens(self.weight):
            # Rounded back to the weight's dtype, as its own matmul would leave them (greedy ties
            # then break as in transformers).
            local = dense.linear_widened(hidden, self.weight, self.packed)[1].to(self.weight.dtype)
        else:
            local = dense.linear(hidden, self.weight, self.packed)
        return all_gather_last_dim(local, self.group)[:, : self.vocab_size]
