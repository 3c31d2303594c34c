"""Multi-token prediction (DeepSeek-V3, Megatron-Core's MultiTokenPredictionBlock).

Depth k = 1..D (model.mtp_num_layers) predicts token t+k+1 at position t. With h^0 the main model's
last hidden state before its final norm and Emb the model's (shared) input embedding:

    h'^k_t  = eh_proj([enorm(Emb(x_{t+k})); hnorm(h^{k-1}_t)])     (2h -> h; Megatron's order:
                                                                     embedding first, then hidden)
    h^k     = TransformerLayer_k(h'^k)                               (the kind of the model's last
                                                                     layer: MLA / MoE if those are)
    logits^k = Head(final_norm(h^k))                                 (the shared output layer)
    L_mtp   = (mtp_loss_scaling_factor / D) * sum_k CE(logits^k_t, x_{t+k+1})

Token ids and labels of depth k are the main ones rolled k places left along the sequence (the
last k positions get id 0 and no label), as Megatron's `roll_tensor`. Under context parallelism a
rank holds chunks r and 2cp-1-r of the sequence, so the roll crosses ranks: `rolled_targets`
all-gathers the (b, s) ids and labels over CP (integers, a few KB), rolls the whole sequence and
keeps this rank's chunks again — the same tokens Megatron's boundary exchange delivers.

Tensor parallelism: eh_proj is column-parallel as in Megatron (its (h, 2h) weight split by output
rows), its (b, s, h/tp) output all-gathered along the hidden dim (Megatron's
gather_from_tensor_model_parallel_region) and, under sequence parallelism, cut back to this rank's
s/tp tokens; the norms and the layer are the model's own TP / SP layers.

The loss: L_mtp's token sum is given the gradient of the LM loss's token sum (`AttachLoss`), so it
is divided by exactly what the LM loss is divided by (the global batch's target tokens, or
Megatron's per-micro-batch divisor): every layout agrees. Megatron's calculate_per_token_loss
additionally multiplies depth k by this rank's (LM tokens / depth-k tokens) (s/(s-k) for unpadded
rows), from local counts that differ between layouts; fivefold leaves that ratio out. The reported
loss stays the LM loss; `mtp_loss` (metrics) is the mean over depths of the unscaled MTP loss.

Parameters: `mtp.<k-1>.{enorm,hnorm,eh_proj,layer.*,final_norm}`; the layer's MoE (if any) is
`layers`-like (`mtp.0.layer.mlp.experts.5...`). The module lives on the last pipeline stage, which
then also holds a copy of the input embedding (fivefold.pipeline.stages keeps the copies equal).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.data.loader import IGNORE_INDEX
from fivefold.errors import NotImplementedYet, UserError
from fivefold.model.block import DecoderLayer
from fivefold.model.norm import make_norm
from fivefold.parallel.context.context_parallel import gather_tokens, split_sequence
from fivefold.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from fivefold.parallel.tensor.layers import SEQ_DIM, ColumnParallelLinear, TPMode, mark_sequence_sharded
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


def check_mtp_supported(cfg: ModelConfig) -> None:
    if cfg.mtp_num_layers is None:
        return
    if cfg.mtp_num_layers < 1:
        raise UserError(f"model.mtp_num_layers={cfg.mtp_num_layers} must be >= 1 (or unset: no multi-token "
                        "prediction)")
    if cfg.position_embedding_type == "learned_absolute":
        raise NotImplementedYet("model.mtp_num_layers with position_embedding_type='learned_absolute' (MTP is built "
                                "for rope and none: Megatron rolls the learned positions too; not implemented yet)")


class AttachLoss(torch.autograd.Function):
    """y = main forward; backward gives `extra` the gradient `main` gets (Megatron's
    MTPLossAutoScaler): `extra` is trained as if added to `main`, scaled and divided as `main` is,
    while the value the caller reports stays `main`."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.clone()


def rolled_targets(ids: torch.Tensor, labels: torch.Tensor, depths: int, cp=None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (ids, labels) of depth k = 1..depths: the whole sequence's rolled k places left
    (id 0 and IGNORE_INDEX shifted in at the end), in this CP rank's chunk order. ids, labels:
    (b, s/cp) as the model holds them (parallel.context.context_parallel.split_tokens)."""
    both = torch.stack([ids, labels], -1)  # (b, s/cp, 2)
    n = 1 if cp is None else cp.size
    whole = gather_tokens(both, cp, tag="mtp-roll") if n > 1 else both  # (b, s, 2) in sequence order
    end = torch.tensor([0, IGNORE_INDEX], dtype=both.dtype, device=both.device).expand(both.shape[0], 1, 2)
    out = []
    for _ in range(depths):
        whole = torch.cat([whole[:, 1:], end], 1)  # (b, s, 2)
        mine = split_sequence(whole, 1, n, cp.rank) if n > 1 else whole  # (b, s/cp, 2)
        out.append((mine[..., 0], mine[..., 1]))
    return out


class MTPLayer(nn.Module):
    """One depth: [enorm(emb); hnorm(h)] -> eh_proj -> a decoder layer -> final_norm."""

    def __init__(self, cfg: ModelConfig, tp: Group | None, mode: TPMode, *, depth: int, moe=None):
        super().__init__()
        h = cfg.hidden_size
        self.tp, self.mode = tp, mode
        self.enorm, self.hnorm = make_norm(cfg, h), make_norm(cfg, h)
        self.eh_proj = nn.Linear(2 * h, h, bias=False) if tp is None else \
            ColumnParallelLinear(2 * h, h, group=tp, mode=mode)
        self.layer = DecoderLayer(cfg, tp, mode, layer=cfg.num_layers + depth - 1, moe=moe)
        self.final_norm = make_norm(cfg, h)
        if tp is not None and mode is TPMode.SEQUENCE_PARALLEL:
            for norm in (self.enorm, self.hnorm, self.final_norm):
                mark_sequence_sharded(norm)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor, cos, sin, bounds=None, noise=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden h^{k-1}, emb Emb(x_{t+k}): (b, s', h) as the residual stream is held (s' = s/tp
        under SP). Returns (h^k, the next depth's input; final_norm(h^k), for the shared head)."""
        x = torch.cat([self.enorm(emb), self.hnorm(hidden)], -1)  # (b, s', 2h)
        x = self.eh_proj(x)  # (b, s, h/tp) with TP (SP gathers the sequence), else (b, s, h)
        if self.tp is not None:
            x = comm.gather_split(x, -1, self.tp, "tp")  # (b, s, h)
            if self.mode is TPMode.SEQUENCE_PARALLEL:
                x = comm.split(x, SEQ_DIM, self.tp, "tp")  # (b, s/tp, h)
        x = self.layer(x, cos, sin, bounds, noise)  # h^k: (b, s', h)
        return x, self.final_norm(x)


def token_losses(logits: torch.Tensor, labels: torch.Tensor, tp: Group | None, vocab_size: int,
                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum over target tokens of -log p(label) (fp32) of (b, s, V_padded[/tp]) logits."""
    if tp is not None:
        losses, _ = vocab_parallel_cross_entropy(logits, labels, tp, vocab_size, ignore_index)
        return losses.sum()
    return F.cross_entropy(logits[..., :vocab_size].float().flatten(0, 1), labels.flatten(),
                           ignore_index=ignore_index, reduction="sum")
