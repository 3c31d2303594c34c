"""Grouped-query self-attention with RoPE, through scaled_dot_product_attention (causal).

a query heads share g key/value heads (a % g == 0); query head i reads KV head i // (a/g), the
same grouping as HF's repeat_kv. head_dim d is independent of h/a:
    q = x W_q (h -> a*d), k = x W_k (h -> g*d), v = x W_v (h -> g*d)
    o = softmax(rope(q) rope(k)^T / sqrt(d) + causal) v,   y = o W_o (a*d -> h)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.model.rope import apply_rope


class Attention(nn.Module):
    """q/k/v_proj are column-parallel candidates (split by heads), o_proj row-parallel."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, self.d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.kv_heads
        self.q_proj = nn.Linear(h, self.heads * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(self.heads * self.d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.d).transpose(1, 2)  # (b, a, s, d)
        k = self.k_proj(x).view(b, s, -1, self.d).transpose(1, 2)  # (b, g, s, d)
        v = self.v_proj(x).view(b, s, -1, self.d).transpose(1, 2)  # (b, g, s, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])  # (b, a, s, d)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))  # (b, s, a*d) -> (b, s, h)
