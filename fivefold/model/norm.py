"""The two normalizations Megatron-Core offers (`--normalization RMSNorm | LayerNorm`), both over the
last dimension, computed in fp32 and returned in x's dtype:
    RMSNorm:   y = w * x / sqrt(mean(x^2) + eps)                       (HF Llama / DeepSeek)
    LayerNorm: y = w * (x - mean(x)) / sqrt(var(x) + eps) + b          (biased variance, as torch)
`make_norm(cfg, size)` picks the one `cfg.normalization` names for every norm of the decoder.
With cfg.apply_layernorm_1p (Megatron's --apply-layernorm-1p) the stored gain is g and the norm
uses w = 1 + g, g initialised to zeros (`zero_centered`): weight decay then pulls w towards 1.

`SplitRMSNorm`: an RMSNorm whose n features a column-parallel linear split over TP (OLMoE's q / k
norms span the whole q or k projection, a*d or g*d, while a TP rank holds only its heads' rows):
    S = sum_r sum(x_r^2)               (all-reduce over TP of each rank's sum of squares)
    y_r = w_r * x_r / sqrt(S / n + eps)  (rank r: its features x_r and their gains w_r)
Every rank uses S for its own features, so the local sums' gradient is the sum of every rank's
dL/dS: `comm.sum_shared` (all-reduce forward and backward). Features held as replicas (KV heads
replicated when TP > KV heads) add their sum of squares / replicas, so each counts once. Per token:
sequence and context parallelism change nothing (the column-parallel output has all of this CP
rank's tokens, SP or not).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config.schema import NORMALIZATIONS, ModelConfig
from fivefold.errors import UserError
from fivefold.parallel.param_meta import Shard, set_meta
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned gain w (initialised to ones)."""

    def __init__(self, size: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(size) if zero_centered else torch.ones(size))

    def gain(self) -> torch.Tensor:
        """w, or 1 + g when the stored weight is zero-centred."""
        return self.weight + 1 if self.zero_centered else self.weight

    def mean_square(self, x32: torch.Tensor) -> torch.Tensor:
        """mean(x^2) over the last dimension, (..., 1)."""
        return x32.pow(2).mean(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(self.mean_square(x32) + self.eps)
        return self.gain() * x32.to(x.dtype)


class SplitRMSNorm(RMSNorm):
    """The gains `rows` of an RMSNorm of width `size`, over the same rows of x (a TP shard, like the
    rows of the column-parallel weight it follows); see the module docstring."""

    def __init__(self, size: int, eps: float, zero_centered: bool = False, *, group: Group, rows: range,
                 replicas: int = 1):
        super().__init__(len(rows), eps, zero_centered)
        self.group, self.size, self.replicas = group, size, replicas
        set_meta(self, "weight", shard=Shard((size,), 0, rows.start, len(rows), group.name))

    def mean_square(self, x32: torch.Tensor) -> torch.Tensor:
        local = x32.pow(2).sum(-1, keepdim=True) / self.replicas  # (b, s, 1): this rank's share
        return comm.sum_shared(local, self.group, "qk-norm") / self.size  # (b, s, 1): over all n features


class LayerNorm(nn.Module):
    """Layer norm over the last dimension with a learned gain w (ones) and bias b (zeros); the whole
    affine map runs in fp32 (as Megatron's fused and TE LayerNorm do) and the result is cast back."""

    def __init__(self, size: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(size) if zero_centered else torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    gain = RMSNorm.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (x.shape[-1],), self.gain().float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


def make_norm(cfg: ModelConfig, size: int) -> RMSNorm | LayerNorm:
    """The norm `cfg.normalization` names, of width `size`, with epsilon cfg.norm_epsilon."""
    if cfg.normalization == "RMSNorm":
        return RMSNorm(size, cfg.norm_epsilon, cfg.apply_layernorm_1p)
    if cfg.normalization == "LayerNorm":
        return LayerNorm(size, cfg.norm_epsilon, cfg.apply_layernorm_1p)
    raise UserError(f"model.normalization={cfg.normalization!r} is not one of {', '.join(NORMALIZATIONS)} "
                    "(Megatron's --normalization; try RMSNorm)")
