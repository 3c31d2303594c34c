"""One pre-norm decoder layer: x = x + attn(norm(x)); x = x + mlp(norm(x)).

attn is grouped-query attention (attention.py) or multi-head latent attention (mla.py) as
cfg.multi_latent_attention says; norm is RMSNorm or LayerNorm as cfg.normalization says (norm.py);
mlp is the dense SwiGLU or, in a MoE model past its first moe_first_k_dense_layers, MoE (moe.py).
"""
from __future__ import annotations

import torch
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.model.attention import Attention
from fivefold.model.dropout import ATTENTION_OUT, MLP_OUT, dropped
from fivefold.model.mla import MLAttention
from fivefold.model.moe import MoEGroups, build_mlp
from fivefold.model.norm import make_norm
from fivefold.parallel.tensor.layers import TPMode, mark_sequence_sharded


def rotary_dim(cfg: ModelConfig) -> int:
    """Width of the RoPE tables: the head dim, or MLA's decoupled rope part qk_pos_emb_head_dim."""
    return cfg.qk_pos_emb_head_dim if cfg.multi_latent_attention else cfg.head_dim


class DecoderLayer(nn.Module):
    """`tp` (a Group of > 1 rank, or None) and `mode` make attention and MLP tensor-parallel; under
    SEQUENCE_PARALLEL x and the norms hold (b, s/tp, h) and the norms' gradients are summed over TP."""

    def __init__(self, cfg: ModelConfig, tp=None, mode: TPMode = TPMode.ALL_REDUCE, *, layer: int = 0,
                 moe: MoEGroups | None = None):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.hidden_size)
        self.attn = MLAttention(cfg, tp, mode) if cfg.multi_latent_attention else Attention(cfg, tp, mode)
        self.attn.layer = self.layer = layer
        self.mlp_norm = make_norm(cfg, cfg.hidden_size)
        self.mlp = build_mlp(cfg, layer, tp, mode, moe)  # dense SwiGLU, or MoE (layer >= first_k_dense)
        if tp is not None and mode is TPMode.SEQUENCE_PARALLEL:
            for norm in (self.attn_norm, self.mlp_norm):
                mark_sequence_sharded(norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs=None, noise=None,
                cache: list | None = None) -> torch.Tensor:
        """`docs`: the batch's document boundaries (fivefold.ops.attention.Documents) or None;
        `noise`: this forward's dropout (fivefold.model.dropout.Noise) or None; `cache`: the
        attention's key / value cache when generating (fivefold.model.generate), else None."""
        attn = self.attn(self.attn_norm(x), cos, sin, docs, noise, **({"cache": cache} if cache is not None else {}))
        x = x + dropped(noise, attn, self.layer, ATTENTION_OUT)  # (b, s, h)
        return x + dropped(noise, self.mlp(self.mlp_norm(x)), self.layer, MLP_OUT)  # (b, s, h)
