"""Learned absolute position embeddings (GPT-2's and Megatron's default, --position-embedding-type
learned_absolute): hidden_0[t] = E_tok[id_t] + E_pos[p_t], E_pos a (max_position_embeddings, h) table.

The table is replicated on every rank of the embedding stage. Each rank looks up the positions of
the tokens it holds: p_t is the token's global position (its CP chunk's offsets; packed documents'
restarts with reset_position_ids), and under sequence parallelism the rank's s/tp slice of them, so
every layout adds the same row to the same token. The gradient of a row is then split over the CP
ranks (summed with the other gradients over DP x CP) and, under SP, over TP (tp_grad_sum).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config.schema import POSITION_EMBEDDINGS, ModelConfig
from fivefold.errors import NotImplementedYet, UserError
from fivefold.parallel.tensor.layers import TPMode, mark_sequence_sharded


class LearnedPositions(nn.Module):
    """positions (s,) or (b, s) of this rank's whole (CP) sequence -> (s', h) or (b, s', h) rows of
    the table, s' = s, or this TP rank's s/tp slice under SP."""

    def __init__(self, rows: int, hidden: int, tp=None, mode: TPMode = TPMode.ALL_REDUCE):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.tp = tp if mode is TPMode.SEQUENCE_PARALLEL else None
        if self.tp is not None:
            mark_sequence_sharded(self)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            n = positions.shape[-1] // self.tp.size
            positions = positions[..., self.tp.rank * n:(self.tp.rank + 1) * n]  # this rank's s/tp
        return F.embedding(positions, self.weight)


def learned_positions(cfg: ModelConfig, tp=None, mode: TPMode = TPMode.ALL_REDUCE) -> LearnedPositions | None:
    """The embedding stage's position table, or None when positions are RoPE's or none."""
    if cfg.position_embedding_type != "learned_absolute":
        return None
    return LearnedPositions(cfg.max_position_embeddings, cfg.hidden_size, tp, mode)


def check_positions_supported(cfg: ModelConfig) -> None:
    """Refuse a position type we do not know, and MLA without RoPE (its decoupled rope part needs it)."""
    if cfg.position_embedding_type not in POSITION_EMBEDDINGS:
        raise UserError(f"model.position_embedding_type={cfg.position_embedding_type!r} is not one of "
                        f"{', '.join(POSITION_EMBEDDINGS)} (Megatron's --position-embedding-type; try rope)")
    if cfg.multi_latent_attention and cfg.position_embedding_type != "rope":
        raise NotImplementedYet(f"model.position_embedding_type={cfg.position_embedding_type!r} with "
                                "multi_latent_attention: MLA is built with RoPE only (not implemented yet)")
