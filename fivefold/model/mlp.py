"""The dense MLPs, as cfg.activation names them (optional biases b: Megatron's --add-bias-linear):
    swiglu: y = W_down (silu(W_gate x + b_gate) * (W_up x + b_up)) + b_down
    gelu:   y = W_fc2 gelu(W_fc1 x + b_fc1) + b_fc2        (Megatron's default MLP, exact erf GeLU)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.parallel.tensor.layers import TPMode, column_linears, linear


class SwiGLU(nn.Module):
    """gate_proj/up_proj column-parallel (h -> f/tp), down_proj row-parallel (f/tp -> h) when `tp`
    has > 1 rank; silu(gate) * up is elementwise, so each rank's f/tp slice needs no communication."""

    def __init__(self, hidden: int, ffn: int, tp=None, mode: TPMode = TPMode.ALL_REDUCE, *, bias: bool = False):
        super().__init__()
        self.gate_proj = linear(hidden, ffn, tp=tp, split="column", mode=mode, bias=bias)
        self.up_proj = linear(hidden, ffn, tp=tp, split="column", mode=mode, bias=bias)
        self.down_proj = linear(ffn, hidden, tp=tp, split="row", mode=mode, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_linears(x, [self.gate_proj, self.up_proj])  # (b, s, f/tp) each
        return self.down_proj(F.silu(gate) * up)  # (b, s, h), or (b, s/tp, h) under SP


class GeluMLP(nn.Module):
    """fc1 column-parallel (h -> f/tp), fc2 row-parallel (f/tp -> h) when `tp` has > 1 rank; GeLU is
    elementwise, so each rank's f/tp slice needs no communication (Megatron's ParallelMLP)."""

    def __init__(self, hidden: int, ffn: int, tp=None, mode: TPMode = TPMode.ALL_REDUCE, *, bias: bool = False):
        super().__init__()
        self.fc1 = linear(hidden, ffn, tp=tp, split="column", mode=mode, bias=bias)
        self.fc2 = linear(ffn, hidden, tp=tp, split="row", mode=mode, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (b, s, f/tp) -> (b, s, h), or (b, s/tp, h) under SP


def dense_mlp(cfg, tp=None, mode: TPMode = TPMode.ALL_REDUCE) -> nn.Module:
    """The dense MLP cfg.activation names, of width cfg.ffn_size, biased with cfg.add_bias_linear."""
    kind = {"swiglu": SwiGLU, "gelu": GeluMLP}[cfg.activation]
    return kind(cfg.hidden_size, cfg.ffn_size, tp, mode, bias=cfg.add_bias_linear)
