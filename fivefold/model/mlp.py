"""SwiGLU MLP: y = W_down (silu(W_gate x) * (W_up x)), no biases."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPMode, column_linears


class SwiGLU(nn.Module):
    """gate_proj/up_proj column-parallel (h -> f/tp), down_proj row-parallel (f/tp -> h) when `tp`
    has > 1 rank; silu(gate) * up is elementwise, so each rank's f/tp slice needs no communication."""

    def __init__(self, hidden: int, ffn: int, tp=None, mode: TPMode = TPMode.ALL_REDUCE):
        super().__init__()
        if tp is None:
            self.gate_proj = nn.Linear(hidden, ffn, bias=False)
            self.up_proj = nn.Linear(hidden, ffn, bias=False)
            self.down_proj = nn.Linear(ffn, hidden, bias=False)
        else:
            self.gate_proj = ColumnParallelLinear(hidden, ffn, group=tp, mode=mode)
            self.up_proj = ColumnParallelLinear(hidden, ffn, group=tp, mode=mode)
            self.down_proj = RowParallelLinear(ffn, hidden, group=tp, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_linears(x, [self.gate_proj, self.up_proj])  # (b, s, f/tp) each
        return self.down_proj(F.silu(gate) * up)  # (b, s, h), or (b, s/tp, h) under SP
