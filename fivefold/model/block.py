"""One pre-norm decoder layer: x = x + attn(norm(x)); x = x + mlp(norm(x)), the MLP dense or MoE."""
from __future__ import annotations

import torch
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.model.attention import Attention
from fivefold.model.moe import MoEGroups, build_mlp
from fivefold.model.norm import RMSNorm
from fivefold.parallel.tensor import TPMode, mark_sequence_sharded


class DecoderLayer(nn.Module):
    """`tp` (a Group of > 1 rank, or None) and `mode` make attention and MLP tensor-parallel; under
    SEQUENCE_PARALLEL x and the norms hold (b, s/tp, h) and the norm gains' gradients are summed over TP."""

    def __init__(self, cfg: ModelConfig, tp=None, mode: TPMode = TPMode.ALL_REDUCE, *, layer: int = 0,
                 moe: MoEGroups | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attn = Attention(cfg, tp, mode)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = build_mlp(cfg, layer, tp, mode, moe)  # dense SwiGLU, or MoE (layer >= first_k_dense)
        if tp is not None and mode is TPMode.SEQUENCE_PARALLEL:
            mark_sequence_sharded(self.attn_norm.weight)
            mark_sequence_sharded(self.mlp_norm.weight)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (b, s, h)
        return x + self.mlp(self.mlp_norm(x))  # (b, s, h)
