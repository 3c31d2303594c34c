"""One pre-norm decoder layer: x = x + attn(norm(x)); x = x + mlp(norm(x))."""
from __future__ import annotations

import torch
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.model.attention import Attention
from fivefold.model.mlp import SwiGLU
from fivefold.model.norm import RMSNorm
from fivefold.parallel.tensor import TPMode, mark_sequence_sharded


class DecoderLayer(nn.Module):
    """`tp` (a Group of > 1 rank, or None) and `mode` make attention and MLP tensor-parallel; under
    SEQUENCE_PARALLEL x and the norms hold (b, s/tp, h) and the norm gains' gradients are summed over TP."""

    def __init__(self, cfg: ModelConfig, tp=None, mode: TPMode = TPMode.ALL_REDUCE):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attn = Attention(cfg, tp, mode)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_size, tp, mode)
        if tp is not None and mode is TPMode.SEQUENCE_PARALLEL:
            mark_sequence_sharded(self.attn_norm.weight)
            mark_sequence_sharded(self.mlp_norm.weight)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (b, s, h)
        return x + self.mlp(self.mlp_norm(x))  # (b, s, h)
