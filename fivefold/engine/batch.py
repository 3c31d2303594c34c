"""What the engine takes and returns: a `Batch` of right-padded sequences (ids, the loss mask, the loss's
extra tensors) and the `TokenStats` computed for it (per-token log-probs, entropy, values); `split` cuts a
global batch into a DP rank's share. fivefold.engine.engine says what each position means."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor
    """(n, s) int64, right-padded."""
    loss_mask: torch.Tensor
    """(n, s) 1 where a token's log-probability counts; 0 on prompts and padding."""
    extra: dict[str, torch.Tensor] | None = None
    """Per-token or per-sequence tensors the loss reads (old log-probs, advantages, ...), sliced with the batch."""
    lengths: torch.Tensor | None = None
    """(n,) tokens before the padding (default: every position counts); token-budget micro-batches
    are cut to their longest sequence."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def lengths_list(self) -> list[int]:
        return self.lengths.tolist() if self.lengths is not None else [self.input_ids.shape[1]] * len(self)

    def rows(self, index, width: int | None = None) -> Batch:
        """Sequences `index` (a slice or a list), their positions cut to `width`."""
        cut = (lambda t: t[:, :width] if width is not None and t.dim() == 2 else t)  # noqa: E731
        idx = index if isinstance(index, slice) else torch.as_tensor(index, dtype=torch.long)
        return Batch(cut(self.input_ids[idx]), cut(self.loss_mask[idx]),
                     {k: cut(v[idx]) for k, v in (self.extra or {}).items()},
                     None if self.lengths is None else self.lengths[idx])


@dataclass
class TokenStats:
    logprobs: torch.Tensor
    """(n, s) fp32 log p(ids[t] | ids[<t]); 0 at t = 0."""
    entropy: torch.Tensor
    """(n, s) fp32 entropy of the distribution that predicted ids[t]; 0 at t = 0."""
    values: torch.Tensor | None = None
    """(n, s) fp32 the value head's estimate at the state before ids[t] (a critic); 0 at t = 0; None
    without a value head."""

    @classmethod
    def of(cls, stacked: torch.Tensor) -> TokenStats:
        """From (n, s, 2 or 3): log-probs, entropy[, values] along the last dimension."""
        return cls(*stacked.unbind(-1))

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.logprobs, self.entropy] + ([] if self.values is None else [self.values]), -1)


def split(batch: Batch, dp_size: int, dp_rank: int) -> Batch:
    """This DP rank's contiguous share of a global batch (n divisible by dp_size)."""
    n = len(batch) // dp_size
    return batch.rows(slice(dp_rank * n, (dp_rank + 1) * n))
