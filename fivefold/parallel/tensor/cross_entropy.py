"""Cross-entropy and log-probabilities over a vocabulary split across TP ranks, without any rank
holding the full logits (Megatron's vocab-parallel cross-entropy).

Rank r holds the logits z[:, c] of columns c in [r V/tp, (r+1) V/tp) of the padded vocabulary;
columns c >= vocab_size (padding) are masked to -inf. For each token with label y:
  m        = max_c z_c                      local max, then all-reduce(max) over TP
  S        = sum_c exp(z_c - m)             local sum, then all-reduce(sum)
  z_y                                       the rank holding column y contributes it, the others 0,
                                            summed in the same all-reduce as S (one call, 2 values)
  log p(y) = z_y - m - log S,   loss = -log p(y)
Backward (dlog p(y)/dz_c = [c == y] - softmax_c): each rank computes its columns' softmax from the
saved exp(z - m) / S, so backward needs no communication. Tokens whose label is `ignore_index` get
log p = 0 and no gradient.
"""
from __future__ import annotations

import torch

from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, labels, group: Group, vocab_size: int, ignore_index: int):
        cols = logits_shard.shape[-1]
        start = group.rank * cols
        real = max(0, min(cols, vocab_size - start))  # this rank's columns that are not padding
        z = logits_shard if logits_shard.dtype == torch.float64 else logits_shard.float()  # (..., V/tp), >= fp32
        if real < cols:
            z = z.masked_fill(torch.arange(cols, device=z.device) >= real, float("-inf"))
        m = z.max(dim=-1).values  # (...,)
        comm.all_reduce_(m, group, "tp-loss", op="max")
        e = torch.exp(z - m.unsqueeze(-1))  # (..., V/tp); exp(-inf) = 0 on padding
        local = labels - start
        mine = (local >= 0) & (local < real)
        idx = local.clamp(0, cols - 1).unsqueeze(-1)
        stats = torch.stack([e.sum(dim=-1), torch.where(mine, z.gather(-1, idx).squeeze(-1), 0.0)])
        comm.all_reduce_(stats, group, "tp-loss")
        sum_exp, z_y = stats[0], stats[1]
        valid = labels != ignore_index
        logp = torch.where(valid, z_y - m - torch.log(sum_exp), 0.0)
        softmax = e.div_(sum_exp.unsqueeze(-1))  # in place: the only (..., V/tp) tensor kept
        ctx.save_for_backward(softmax, idx, mine, valid)
        ctx.in_dtype = logits_shard.dtype
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        if getattr(ctx, "spent", False):
            raise RuntimeError("vocab-parallel cross-entropy: backward reuses its saved softmax in place; "
                               "it cannot run twice (retain_graph)")
        ctx.spent = True
        softmax, idx, mine, valid = ctx.saved_tensors
        g = torch.where(valid, grad_logp, 0.0).unsqueeze(-1)  # (..., 1)
        grad = softmax.mul_(-g)  # -softmax_c * g, in place (backward runs once)
        grad.scatter_add_(-1, idx, torch.where(mine.unsqueeze(-1), g, 0.0))  # + [c == y] * g
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_entropy(logits_shard: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
    """Entropy of each token's softmax over the whole vocabulary (fp32, the logits' leading shape) from
    this rank's (..., V_padded/tp) columns, differentiable: with m the global max, S = sum exp(z - m)
    and E = sum exp(z - m) z over all columns (one all-reduce of both, identity backward: the entropy
    is then the same on every TP rank), H = m + log S - E / S."""
    cols = logits_shard.shape[-1]
    real = max(0, min(cols, vocab_size - group.rank * cols))
    z = logits_shard.float()[..., :real]  # padding columns are not part of the vocabulary
    m = z.detach().max(dim=-1).values if real else torch.full(z.shape[:-1], float("-inf"), device=z.device)
    comm.all_reduce_(m, group, "tp-loss", op="max")
    e = torch.exp(z - m.unsqueeze(-1))
    stats = comm.reduce_from(torch.stack([e.sum(-1), (e * z).sum(-1)]), group, tag="tp-loss")
    return m + torch.log(stats[0]) - stats[1] / stats[0]


def vocab_parallel_logprobs(logits_shard: torch.Tensor, labels: torch.Tensor, group: Group, vocab_size: int,
                            ignore_index: int = -100) -> torch.Tensor:
    """log p(label) per token (fp32, or fp64 for fp64 logits; shape of `labels`; 0 where label == ignore_index), from this
    rank's (..., V_padded/tp) logits; differentiable."""
    return _VocabParallelLogProb.apply(logits_shard, labels, group, vocab_size, ignore_index)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, group: Group,
                                 vocab_size: int, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses, per-token log-probabilities), both fp32 with the shape of `labels`;
    loss = -log p(label), 0 where label == ignore_index."""
    logp = vocab_parallel_logprobs(logits_shard, labels, group, vocab_size, ignore_index)
    return -logp, logp
