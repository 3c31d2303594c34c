"""TEMPORARY stand-in for fivefold.model until the runtime work lands; then deleted.

build_model(model_config, seed) -> nn.Module mapping (b, s) ids to (b, s, vocab) logits.
"""
from __future__ import annotations

import torch
from torch import nn

from fivefold.config.schema import ModelConfig


class _Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        layer = nn.TransformerEncoderLayer(h, cfg.num_attention_heads, cfg.ffn_size, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
        return self.head(self.norm(self.layers(self.embed(ids), mask=mask, is_causal=True)))


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Decoder(cfg)
