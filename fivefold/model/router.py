"""The MoE router and its auxiliary losses (Megatron-Core's TopKRouter semantics).

Scores, for router logits z_t = W_r x_t (W_r: (E, h), no bias), computed in fp32:
  softmax: p_t = softmax(z_t) over all E experts; the top-k experts of p_t are chosen and their
           weights are p_t[top-k] renormalised to sum 1 (Mixtral; Megatron's default, where the
           softmax is taken over the top-k logits, which is the same) or, with
           moe_router_pre_softmax, p_t[top-k] as they are (Qwen/OLMoE norm_topk_prob=False).
  sigmoid: p_t = sigmoid(z_t); top-k of p_t, renormalised (p / sum p over the top-k) unless
           moe_router_pre_softmax (DeepSeek-V3's norm_topk_prob=False).
Losses of one micro-batch of T tokens (all of its tokens: the TP / CP / SP shards of a micro-batch
are added over `tokens_group`, so the value does not depend on the layout):
  aux_loss     (Switch / GShard): coeff * E * sum_e f_e P_e,  f_e = c_e / (k T) the fraction of
               the k T assignments that went to expert e, P_e = sum_t q_te / T the mean score,
               q = softmax(z) (sigmoid: sigmoid(z) normalised over E). Megatron's
               switch_load_balancing_loss_func; HF's load_balancing_loss_func is k times this.
  seq_aux_loss: the same per sequence (T = its tokens), averaged over the micro-batch's sequences.
  z_loss       (ST-MoE): coeff * sum_t logsumexp(z_t)^2 / T.
Each rank computes its own tokens' terms (counts c_e are summed over the group first), so the
rank terms add up to the micro-batch's loss and the gradients, summed over the group, are exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fivefold.config.schema import ModelConfig
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


@dataclass
class Routing:
    """One micro-batch's routing on this rank: n tokens, k experts each."""

    experts: torch.Tensor
    """(n, k) int64: the chosen experts of each token, best first."""
    weights: torch.Tensor
    """(n, k) fp32: their weights in the output sum."""
    loss: torch.Tensor | None
    """This rank's term of the auxiliary losses (scalar, fp32), or None when every coeff is 0."""


def _group_sum_(t: torch.Tensor, group: Group | None) -> torch.Tensor:
    if group is not None and group.size > 1:
        comm.all_reduce_(t, group, "moe-aux")
    return t


def route(logits: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (n, E) -> (top-k experts (n, k), their weights (n, k), scores q (n, E) for the aux loss)."""
    k = cfg.moe_router_topk
    logits = logits.float()
    if cfg.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)  # (n, E)
        aux_scores = scores
    elif cfg.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits)  # (n, E)
        aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"moe_router_score_function={cfg.moe_router_score_function!r}")
    top, experts = torch.topk(scores, k, dim=-1)  # (n, k)
    if not cfg.moe_router_pre_softmax and k > 1:
        top = top / (top.sum(-1, keepdim=True) + (1e-20 if cfg.moe_router_score_function == "sigmoid" else 0.0))
    return experts, top, aux_scores


def load_balancing_loss(scores: torch.Tensor, experts: torch.Tensor, cfg: ModelConfig, tokens_group: Group | None,
                        batch: int) -> torch.Tensor:
    """This rank's term of aux_loss (or seq_aux_loss, with `batch` sequences of n/batch tokens here)."""
    e_count, k, coeff = cfg.num_experts, cfg.moe_router_topk, cfg.moe_aux_loss_coeff
    group_size = tokens_group.size if tokens_group is not None else 1
    hits = F.one_hot(experts, e_count).sum(1).double()  # (n, E): 1 where token t went to expert e
    if cfg.moe_router_load_balancing_type == "seq_aux_loss":
        n_seq = scores.shape[0] // batch * group_size  # tokens of one sequence (all shards)
        counts = _group_sum_(hits.view(batch, -1, e_count).sum(1), tokens_group)  # (b, E)
        per_seq = (counts.to(scores.dtype) * scores.view(batch, -1, e_count).sum(1)).sum(-1)  # (b,)
        return per_seq.sum() * (coeff * e_count / (k * n_seq * n_seq * batch))
    total = scores.shape[0] * group_size  # T: tokens of the micro-batch on all shards
    counts = _group_sum_(hits.sum(0), tokens_group)  # (E,)
    return (counts.to(scores.dtype) * scores.sum(0)).sum() * (coeff * e_count / (k * total * total))


def z_loss(logits: torch.Tensor, coeff: float, tokens_group: Group | None) -> torch.Tensor:
    """This rank's term of coeff * sum_t logsumexp(z_t)^2 / T."""
    total = logits.shape[0] * (tokens_group.size if tokens_group is not None else 1)
    return torch.logsumexp(logits.float(), dim=-1).square().sum() * (coeff / total)


class AttachAuxLoss(torch.autograd.Function):
    """Megatron's MoEAuxLossAutoScaler: y = x forward; backward passes dL/dy through and gives the
    auxiliary loss the gradient `scale` (d(scale * aux)/d aux), so the aux loss reaches the router
    weights through the same backward as the LM loss while the reported loss stays the LM loss.
    `scale` = micro_batch_size / global_batch_size: the aux loss is averaged over the micro-batches
    of the step (all DP ranks), as Megatron scales it by 1/num_microbatches and averages over DP."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class Router(torch.nn.Module):
    """z = x W_r^T (no bias), the top-k routing and this rank's aux/z-loss term."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, batch: int, tokens_group: Group | None) -> Routing:
        """x (n, h): this rank's tokens of a micro-batch of `batch` sequences."""
        cfg = self.cfg
        logits = F.linear(x, self.weight).float()  # (n, E), fp32 as Megatron's router
        experts, weights, scores = route(logits, cfg)
        loss = None
        if cfg.moe_aux_loss_coeff and cfg.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss"):
            loss = load_balancing_loss(scores, experts, cfg, tokens_group, batch)
        if cfg.moe_z_loss_coeff:
            z = z_loss(logits, cfg.moe_z_loss_coeff, tokens_group)
            loss = z if loss is None else loss + z
        return Routing(experts, weights, loss)
