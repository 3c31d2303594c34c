"""A DP rank's microbatches for each step, and the token count of the whole global batch.

The loss of a step is the per-token mean over the global batch: sum of every target token's loss on
every rank and microbatch, divided by `StepBatch.global_tokens`. Every rank computes that count from
the global batch itself (no communication): G * S for packed samples, the sum of each sample's
target tokens otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fivefold.data.dataset import DocumentDataset, PackedDataset
from fivefold.data.documents import DocumentRules, PackedDocs, mask_eod_targets, packed_docs
from fivefold.config.batch_sizes import BatchSizes
from fivefold.data.sampler import balanced_partition, even_share, global_batch_indices

IGNORE_INDEX = -100
"""Label of padding positions (variable-length samples): no loss, not counted."""


@dataclass
class Microbatch:
    input_ids: torch.Tensor
    """(b, s) int64 token ids."""
    labels: torch.Tensor
    """(b, s) int64 next-token targets, IGNORE_INDEX on padding."""
    num_tokens: int
    """Target tokens (labels != IGNORE_INDEX)."""
    docs: PackedDocs | None = None
    """Packed documents (data.reset_attention_mask / reset_position_ids), or None."""
    sample_ids: torch.Tensor | None = None
    """(b,) int64 dataset index of each row (dropout masks are a function of it), or None."""


@dataclass
class StepBatch:
    microbatches: list[Microbatch]
    global_tokens: int
    """Target tokens in the whole global batch, over all DP ranks."""
    sample_ids: np.ndarray
    """This rank's sample ids (for tests and debugging)."""
    step: int | None = None
    """The optimizer step this batch is for (dropout masks are a function of it), or None."""
    global_samples: int = 0
    """Samples in the whole global batch, over all DP ranks (0: not known, a hand-made batch)."""
    global_microbatches: int = 0
    """Microbatches of the whole global batch, over all DP ranks (0: this rank's, a hand-made batch)."""

    def loss_divisors(self, per_token: bool) -> list[float]:
        """What each microbatch's loss sum is divided by: the global batch's target tokens (the
        per-token mean; Megatron's --calculate-per-token-loss), or Megatron's default, its own target
        tokens times the global batch's microbatches (the mean of per-microbatch means)."""
        if per_token:
            return [self.global_tokens] * len(self.microbatches)
        m = self.global_microbatches or len(self.microbatches)
        return [max(1, mb.num_tokens) * m for mb in self.microbatches]


def collate(samples: list[np.ndarray], rules: DocumentRules | None = None) -> Microbatch:
    """Right-pad to the longest sample; inputs are tokens[:-1], targets tokens[1:]; with document
    `rules`, targets at EOD inputs dropped (eod_mask_loss) and the documents found."""
    width = max(len(s) for s in samples) - 1
    inputs = torch.zeros(len(samples), width, dtype=torch.int64)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.int64)
    for i, s in enumerate(samples):
        t = torch.from_numpy(np.asarray(s, dtype=np.int64))
        inputs[i, : len(s) - 1] = t[:-1]
        labels[i, : len(s) - 1] = t[1:]
    labels = mask_eod_targets(inputs, labels, rules, IGNORE_INDEX)
    return Microbatch(inputs, labels, int((labels != IGNORE_INDEX).sum()), packed_docs(inputs, rules))


def _eod_targets(sample: np.ndarray, rules: DocumentRules | None) -> int:
    """Targets eod_mask_loss drops from a sample: its EOD inputs (every token but the last)."""
    if rules is None or not rules.eod_mask_loss:
        return 0
    return int((np.asarray(sample[:-1]) == rules.eod_id).sum())


class BatchLoader:
    """Rank `dp_rank` of `dp_size`: its microbatches of global batch `step`, for any step (random access,
    so resuming at step k needs only k)."""

    def __init__(self, dataset: PackedDataset | DocumentDataset, *, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True,
                 documents: DocumentRules | None = None, sizes: BatchSizes | None = None):
        """`sizes`: each step's global batch under a batch-size schedule (default: global_batch_size)."""
        if len(dataset) == 0:
            raise ValueError("empty dataset")
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.documents, self.sizes = documents, sizes

    def step_batch(self, step: int) -> StepBatch:
        if self.sizes is None:
            ids = global_batch_indices(step, self.global_batch_size, len(self.dataset), self.seed, self.shuffle)
        else:
            ids = global_batch_indices(step, self.sizes.size(step), len(self.dataset), self.seed, self.shuffle,
                                       start=self.sizes.start(step))
        mbs = self.micro_batch_size
        if isinstance(self.dataset, PackedDataset):
            mine = ids[even_share(len(ids), self.dp_rank, self.dp_size)]
            global_microbatches = -(-len(mine) // mbs) * self.dp_size
            global_tokens = len(ids) * self.dataset.seq_length
            if self.documents is not None and self.documents.eod_mask_loss:  # the real targets left
                global_tokens -= sum(_eod_targets(self.dataset[int(i)], self.documents) for i in ids)
        else:
            targets = [self.dataset.target_tokens(int(i)) - _eod_targets(self.dataset[int(i)], self.documents)
                       for i in ids]
            bounds = balanced_partition(targets, self.dp_size)
            mine = ids[bounds[self.dp_rank]: bounds[self.dp_rank + 1]]
            global_tokens = sum(targets)
            global_microbatches = sum(-(-(b - a) // mbs) for a, b in zip(bounds, bounds[1:]))
        micro = [collate([self.dataset[int(i)] for i in mine[k: k + mbs]], self.documents)
                 for k in range(0, len(mine), mbs)]
        for k, mb in zip(range(0, len(mine), mbs), micro):
            mb.sample_ids = torch.as_tensor(np.asarray(mine[k: k + mbs], dtype=np.int64))
        return StepBatch(micro, global_tokens, mine, step, len(ids), global_microbatches)
