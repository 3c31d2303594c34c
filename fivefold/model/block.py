"""One pre-norm decoder layer: x = x + attn(norm(x)); x = x + mlp(norm(x))."""
from __future__ import annotations

import torch
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.model.attention import Attention
from fivefold.model.mlp import SwiGLU
from fivefold.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (b, s, h)
        return x + self.mlp(self.mlp_norm(x))  # (b, s, h)
