"""Per-token adapter slots grouped into segments, the one input every kernel reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    """Which LoRA slot each token of a batch uses; −1 means "no adapter".

    Segments are maximal runs of consecutive tokens with the same slot; kernels parallelise over
    them. An empty batch (an idle DP group) has zero tokens and zero segments.
    """

    token_slots: torch.Tensor  # [T] int32
    seg_starts: torch.Tensor  # [S] int32
    seg_lens: torch.Tensor  # [S] int32
    seg_slots: torch.Tensor  # [S] int32, −1 allowed
    max_seg_len: int
    active_slots: tuple[int, ...]  # distinct slots ≥ 0, ascending

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return int(self.token_slots.shape[0])

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoraBatch:
        """Build the segment view of a [T] slot vector (any integer dtype, any device)."""
        slots = token_slots.to(torch.int32)
        total = int(slots.shape[0])
        if total == 0:
            empty = torch.zeros(0, dtype=torch.int32, device=slots.device)
            return cls(slots, empty, empty, empty, 0, ())
        cpu = slots.cpu()
        change = torch.ones(total, dtype=torch.bool)
        change[1:] = cpu[1:] != cpu[:-1]
        starts = torch.nonzero(change).flatten().to(torch.int32)
        ends = torch.cat([starts[1:], torch.tensor([total], dtype=torch.int32)])
        lens = ends - starts
        seg_slots = cpu[starts.long()]
        active = tuple(sorted({int(s) for s in seg_slots.tolist() if s >= 0}))
        device = slots.device
        return cls(
            token_slots=slots,
            seg_starts=starts.to(device),
            seg_lens=lens.to(device),
            seg_slots=seg_slots.to(device),
            max_seg_len=int(lens.max()),
            active_slots=active,
        )
