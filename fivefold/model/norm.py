"""The two normalizations Megatron-Core offers (`--normalization RMSNorm | LayerNorm`), both over the
last dimension, computed in fp32 and returned in x's dtype:
    RMSNorm:   y = w * x / sqrt(mean(x^2) + eps)                       (HF Llama / DeepSeek)
    LayerNorm: y = w * (x - mean(x)) / sqrt(var(x) + eps) + b          (biased variance, as torch)
`make_norm(cfg, size)` picks the one `cfg.normalization` names for every norm of the decoder.
With cfg.apply_layernorm_1p (Megatron's --apply-layernorm-1p) the stored gain is g and the norm
uses w = 1 + g, g initialised to zeros (`zero_centered`): weight decay then pulls w towards 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config.schema import NORMALIZATIONS, ModelConfig
from fivefold.errors import UserError


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned gain w (initialised to ones)."""

    def __init__(self, size: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(size) if zero_centered else torch.ones(size))

    def gain(self) -> torch.Tensor:
        """w, or 1 + g when the stored weight is zero-centred."""
        return self.weight + 1 if self.zero_centered else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.gain() * x32.to(x.dtype)


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
