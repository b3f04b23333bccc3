"""Sampling (docs/serving.md): the next token of each sequence from its last-token logits.

One function, `sample`, run identically on every rank of an attention group (they hold the same
logits), so every rank appends the same token without a broadcast. Per sequence:

* temperature 0 (below `GREEDY_BELOW`): greedy, the first maximum on ties;
* otherwise the logits are divided by the temperature and filtered, in transformers' order, by
  top-k, then top-p (on the top-k distribution renormalised), then min-p; the token is then
  drawn from what is left by an exponential race (argmax of `p / E`, `E ~ Exp(1)`), which
  samples exactly from `p` and never picks a token of probability zero.

The noise of a draw depends only on the sequence's seed and the index of the token being drawn
(its own generator, seeded from both), never on the batch: the same request with the same seed
gives the same tokens alone or among any companions, and after a preemption by recompute. The
driver gives unseeded requests a seed, so every rank agrees.

Logprobs are those of the model's distribution (`log_softmax` of the raw logits, before
temperature and filtering), as vLLM reports by default.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from node_agent.backend import Sampling

MAX_LOGPROBS = 20  # OpenAI's limit for top logprobs
_SEED_LIMIT = 2**64
# Temperatures below this are greedy: the limit is argmax anyway, and dividing by a vanishing
# temperature would overflow fp32 (vLLM uses the same cut-off).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """The seam's `Sampling` (its fields, written there once), checked: invalid values raise
    ValueError naming the field.

    `top_k` 0 and `top_p` 1 and `min_p` 0 disable their filter; `logprobs` None returns none, N
    returns the chosen token's logprob and the N most likely tokens'. `seed` None: the driver
    picks one. `stop_token_ids` end the sequence (the driver adds the model's EOS ids).
    """

    def __post_init__(self) -> None:
        _require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "a finite number ≥ 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer ≥ 0 (0: off)", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < _SEED_LIMIT),
            "seed",
            "None or an integer in [0, 2**64)",
            self.seed,
        )
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer ≥ 1", self.max_tokens)
        _require(
            isinstance(self.stop_token_ids, tuple) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a tuple of token ids ≥ 0",
            self.stop_token_ids,
        )
        _require(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"None or an integer in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )

    @property
    def greedy(self) -> bool:
        """Temperature (about) 0: argmax, no randomness."""
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class SequenceSampling:
    """One row of a sampling batch: its parameters, its resolved seed, and which token it draws
    (`index`: tokens this sequence has generated so far)."""

    params: SamplingParams
    seed: int
    index: int

    def __post_init__(self) -> None:
        if not (_is_int(self.seed) and 0 <= self.seed < _SEED_LIMIT):
            raise ValueError(f"SequenceSampling.seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not (_is_int(self.index) and self.index >= 0):
            raise ValueError(f"SequenceSampling.index must be an integer ≥ 0, got {self.index!r}")


class FinishReason(enum.Enum):
    """Why a sequence ended."""

    STOP = "stop"  # a stop token was generated
    LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and the top-N (highest first, lower id first on ties)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class SampledToken:
    """One sequence's new token, its logprobs if asked for, and whether it ends the sequence."""

    token_id: int
    logprobs: TokenLogprobs | None
    finish: FinishReason | None


def draw_seed(seed: int, index: int) -> int:
    """The generator seed for token `index` of a sequence seeded `seed` (a 64-bit hash of both)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, index), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def finish_reason(params: SamplingParams, token_id: int, generated: int) -> FinishReason | None:
    """Whether a sequence that now has `generated` tokens, the last `token_id`, is done."""
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if generated >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def sample(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> list[SampledToken]:
    """The next token of each sequence from its last-token logits `[num_seqs, vocab]`."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, vocab], got {tuple(logits.shape)}")
    logits = logits.float()
    tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if len(greedy) == len(rows):
        tokens = logits.argmax(dim=-1)  # every row greedy: no gather and scatter of rows
    elif greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    if drawn:
        tokens[drawn] = _draw(logits[drawn], [rows[i] for i in drawn])
    chosen = tokens.tolist()
    logprobs = _logprobs(logits, chosen, rows)
    return [
        SampledToken(token, logprob, finish_reason(row.params, token, row.index + 1))
        for token, logprob, row in zip(chosen, logprobs, rows, strict=True)
    ]


def filtered_probs(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> torch.Tensor:
    """Each row's sampling distribution `[num_rows, vocab]` after temperature, top-k, top-p and
    min-p: exactly 0 outside the kept set. Rows must not be greedy.

    Rows without filters skip the sort. Which path a row takes depends only on its own
    parameters, and each path works row by row, so a row's values never depend on the batch.
    """
    temperature = torch.tensor([row.params.temperature for row in rows], device=logits.device)
    scaled = logits / temperature[:, None]
    probs = scaled.softmax(dim=-1)
    filtered = [i for i, row in enumerate(rows) if _has_filter(row.params)]
    if filtered:
        probs[filtered] = _filter(scaled[filtered], [rows[i].params for i in filtered])
    return probs


def _has_filter(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1 or params.min_p > 0


def _filter(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p on the renormalised rest, then min-p; computed in sorted order."""
    device, vocab = scaled.device, scaled.shape[1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    # Stable: tied logits keep id order, so every rank keeps the same tokens at a top-k edge.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    keep = torch.arange(vocab, device=device)[None, :] < top_k[:, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    # The smallest prefix whose mass reaches top_p (so the first token always stays). Rows with
    # top_p = 1 skip the test: an fp32 cumulative sum can fall short of 1 over a large vocabulary.
    before = probs.cumsum(dim=-1) - probs
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1)
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    keep &= probs >= min_p[:, None] * probs[:, :1]  # a ratio to the top token: renormalising keeps it
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return torch.empty_like(probs).scatter_(1, order, probs)


def _draw(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> torch.Tensor:
    """Exponential race over each row's filtered distribution, noise from the row's own seed."""
    probs = filtered_probs(logits, rows)
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows):
        generator = torch.Generator(device=logits.device).manual_seed(draw_seed(row.seed, row.index))
        noise[i].exponential_(generator=generator)
    # An Exp(1) draw of exactly 0 would turn p / E into inf or nan; clamping keeps zeros at zero,
    # and the largest p (at least 1/vocab) over any E still beats them.
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _logprobs(logits: torch.Tensor, chosen: list[int], rows: Sequence[SequenceSampling]) -> list[TokenLogprobs | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = logits[wanted].log_softmax(dim=-1)
    top_n = max(rows[i].params.logprobs or 0 for i in wanted)
    # A stable sort, not topk: ties must come out in one order on every rank (lower id first).
    sorted_values, sorted_ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    top_values, top_ids = sorted_values[:, :top_n].tolist(), sorted_ids[:, :top_n].tolist()
    index = torch.tensor([[chosen[i]] for i in wanted], device=logits.device)
    chosen_values = logprobs.gather(1, index).squeeze(1).tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        result[i] = TokenLogprobs(chosen_values[j], tuple(top_ids[j][:n]), tuple(top_values[j][:n]))
    return result
