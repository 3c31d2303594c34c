"""Rotary position embedding (RoPE), HF Llama's rotate_half convention.

For head_dim d, frequencies f_j = base^(-2j/d), j < d/2, and angles theta(p, j) = p * f_j. The
halves of each head vector are rotated as complex pairs (x_j, x_{j+d/2}):
    rope(x)_p = x * cos(theta_p) + rotate_half(x) * sin(theta_p),   rotate_half(x) = [-x2, x1]
with cos/sin repeated over both halves. Positions are passed explicitly (0..s-1 for a whole
sequence; a context-parallel shard passes its own positions).
"""
from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (s, d) in fp32 for integer positions (s,); (b, s, d) for per-row
    positions (b, s) (packed documents restarting at 0, fivefold.data.documents)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # ([b,] s, d/2)
    emb = torch.cat((angles, angles), dim=-1)  # (s, d)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, s, d); cos/sin: (s, d) or per row (b, s, d). Rotation in x's dtype (tables cast
    to it, as HF does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, s, d): the same for every head
    return x * cos + rotate_half(x) * sin
