"""The MoE router and its auxiliary losses (Megatron-Core's TopKRouter semantics).

For router logits z_t = W_r x_t (W_r: (E, h), no bias) of token t:
  scores   softmax: p_t = softmax(z_t) over all E experts;  sigmoid: p_t = sigmoid(z_t);
           sqrtsoftplus: p_t = sqrt(softplus(z_t)) = sqrt(log(1 + exp(z_t))).
  choice   the top-k experts of c_t, where c_t = z_t for softmax (the same experts as top-k of p_t:
           softmax is monotone; Megatron takes the top-k logits, then softmax over them) and p_t for
           softmax with moe_router_pre_softmax, and c_t = p_t + b for sigmoid / sqrtsoftplus, b the
           expert bias (zero without moe_router_enable_expert_bias).
           Group-limited (moe_router_group_topk g, moe_router_num_groups G): the E experts are G
           groups of E/G consecutive ones; a group scores the sum of its top k//g entries of c_t,
           and only the experts of the token's g best groups can be chosen (DeepSeek-V3).
  weights  p_t[top-k], renormalised to sum 1 when k > 1 (Mixtral; Megatron) unless
           moe_router_pre_softmax (Qwen/OLMoE norm_topk_prob=False; with sigmoid / sqrtsoftplus
           HF DeepSeek-V3's norm_topk_prob=False), then times moe_router_topk_scaling_factor
           (DeepSeek-V3's routed_scaling_factor). The bias b never enters the weights.
  dtype    moe_router_dtype fp32 / fp64: the linear and everything after it in that dtype, and the
           weighted sum of the experts' outputs too (fivefold.parallel.expert.dispatch); None: the linear in
           the parameters' dtype, the scores in fp32, the weights back in the parameters' dtype.
  forced   moe_router_force_load_balancing: z replaced by standard normal draws of this rank's
           torch generator (the gradient of z passes straight through): every expert gets k/E of
           the tokens in expectation. As Megatron's (per-rank draws), it depends on the layout.
Losses of one micro-batch of T tokens (all of its tokens: the TP / CP / SP shards of a micro-batch
are added over `tokens_group`, so the value does not depend on the layout):
  aux_loss     (Switch / GShard): coeff * E * sum_e f_e P_e,  f_e = c_e / (k T) the fraction of
               the k T assignments that went to expert e, P_e = sum_t q_te / T the mean score,
               q = softmax(z) (sigmoid, sqrtsoftplus: p normalised over E). As Megatron, c_e counts
               the plain top-k of q (no groups, no bias). Megatron's switch_load_balancing_loss_func;
               HF's load_balancing_loss_func is k times this.
  seq_aux_loss: the same per sequence (T = its tokens), averaged over the micro-batch's sequences.
  z_loss       (ST-MoE): coeff * sum_t logsumexp(z_t)^2 / T.
Each rank computes its own tokens' terms (counts c_e are summed over the group first), so the
rank terms add up to the micro-batch's loss and the gradients, summed over the group, are exact.

Aux-loss-free balancing (DeepSeek-V3, arXiv 2408.15664): each training forward adds the tokens it
sent to each expert (after token dropping, as Megatron counts its routing map; `count_load`) to
`tokens_per_expert`; after the step's backward `update_expert_bias` sums
those loads over the TP x CP x DP ranks (every micro-batch and shard of the step's tokens) and moves
b_e += rate * sign(mean_e' load_e' - load_e), so every layout applies the one-process update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fivefold.config.schema import ModelConfig
from fivefold.model.recompute import is_recomputing
from fivefold.ops.counting import bincount
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
"""moe_router_dtype -> the torch dtype the router computes in."""


@dataclass
class Routing:
    """One micro-batch's routing on this rank: n tokens, k experts each."""

    experts: torch.Tensor
    """(n, k) int64: the chosen experts of each token, best first."""
    weights: torch.Tensor
    """(n, k): their weights in the output sum, in the dtype the sum is taken in."""
    loss: torch.Tensor | None
    """This rank's term of the auxiliary losses (scalar), or None when every coeff is 0."""


def _group_sum_(t: torch.Tensor, group: Group | None) -> torch.Tensor:
    if group is not None and group.size > 1:
        comm.all_reduce_(t, group, "moe-aux")
    return t


def scores_of(logits: torch.Tensor, function: str) -> torch.Tensor:
    """p = score(z), (n, E), in the logits' dtype."""
    if function == "softmax":
        return torch.softmax(logits, dim=-1)
    if function == "sigmoid":
        return torch.sigmoid(logits)
    if function == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise ValueError(f"moe_router_score_function={function!r}")


def top_k(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The k experts of each token with the largest `choice` (n, E), best first, within the token's
    moe_router_group_topk best groups when group-limited. Returns (n, k) int64."""
    k, chosen = cfg.moe_router_topk, cfg.moe_router_group_topk
    if not chosen:
        return torch.topk(choice, k, dim=-1).indices
    n, e = choice.shape
    per_group = choice.view(n, cfg.moe_router_num_groups, -1)  # (n, G, E/G)
    group_score = per_group.topk(k // chosen, dim=-1).values.sum(-1)  # (n, G)
    best = group_score.topk(chosen, dim=-1).indices  # (n, g)
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # (n, G)
    masked = per_group.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(n, e)  # (n, E)
    return torch.topk(masked, k, dim=-1).indices


def route(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (n, E), in the dtype the scores are computed in -> (top-k experts (n, k), their weights
    (n, k), scores q (n, E) for the aux loss); `bias` (E,): the expert bias, for the choice only."""
    function, k = cfg.moe_router_score_function, cfg.moe_router_topk
    scores = scores_of(logits, function)  # (n, E)
    if function == "softmax":
        choice = scores if cfg.moe_router_pre_softmax else logits
        aux_scores = scores
    else:
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    experts = top_k(choice, cfg)  # (n, k)
    top = scores.gather(1, experts)  # (n, k)
    if not cfg.moe_router_pre_softmax and k > 1:
        top = top / (top.sum(-1, keepdim=True) + (0.0 if function == "softmax" else 1e-20))
    if cfg.moe_router_topk_scaling_factor:
        top = top * cfg.moe_router_topk_scaling_factor
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
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / total)


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


class RandomLogits(torch.autograd.Function):
    """Megatron's RandomSTE (--moe-router-force-load-balancing): forward returns standard normal
    draws shaped as z (from torch's generator of this process: its state is saved in checkpoints
    and replayed by activation recompute); backward passes dL/dz through unchanged."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Router(torch.nn.Module):
    """z = x W_r^T (no bias), the top-k routing, this rank's aux/z-loss term, and (with
    moe_router_enable_expert_bias) the expert bias and the load counted for its update."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        e = cfg.num_experts
        self.weight = torch.nn.Parameter(torch.empty(e, cfg.hidden_size))
        bias = cfg.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(e) if bias else None)
        """(E,) fp32 whatever the model's dtype (as Megatron keeps it: in bf16 a 1e-3 step is lost once
        |b| >= 0.5); no gradient, saved in checkpoints."""
        self.register_buffer("tokens_per_expert", torch.zeros(e, dtype=torch.int64) if bias else None,
                             persistent=False)
        """(E,) tokens this rank sent to each expert since the last bias update (training forwards)."""

    def _apply(self, fn, recurse=True):
        kept = self.expert_bias
        super()._apply(fn, recurse)
        if kept is not None and self.expert_bias.dtype != kept.dtype:  # a cast: keep the fp32 values
            self.expert_bias = kept.to(self.expert_bias.device)
        return self

    def forward(self, x: torch.Tensor, batch: int, tokens_group: Group | None) -> Routing:
        """x (n, h): this rank's tokens of a micro-batch of `batch` sequences."""
        cfg = self.cfg
        dtype = DTYPES.get(cfg.moe_router_dtype)
        if dtype is None:  # Megatron's unset router dtype: the linear as the model computes, scores in fp32
            logits = F.linear(x, self.weight).float()  # (n, E)
        else:
            logits = F.linear(x.to(dtype), self.weight.to(dtype))  # (n, E)
        if cfg.moe_router_force_load_balancing:
            logits = RandomLogits.apply(logits)
        experts, weights, scores = route(logits, cfg, self.expert_bias)
        loss = None
        if cfg.moe_aux_loss_coeff and cfg.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss"):
            plain = torch.topk(scores, cfg.moe_router_topk, dim=-1).indices  # (n, k): Megatron counts these
            loss = load_balancing_loss(scores, plain, cfg, tokens_group, batch)
        if cfg.moe_z_loss_coeff:
            z = z_loss(logits, cfg.moe_z_loss_coeff, tokens_group)
            loss = z if loss is None else loss + z
        return Routing(experts, weights if dtype is not None else weights.to(x.dtype), loss)


def count_load(router: Router, experts: torch.Tensor) -> None:
    """Add a training forward's assignments `experts` (after token dropping, as Megatron counts its
    routing map) to the load the expert bias moves by; not in eval, no-grad or a recompute's rerun."""
    if router.expert_bias is not None and router.training and torch.is_grad_enabled() and not is_recomputing():
        router.tokens_per_expert += bincount(experts, router.cfg.num_experts)


@torch.no_grad()
def update_expert_bias(routers: list[Router], group: Group | None) -> None:
    """After a step's backward, on every rank of `group` (TP x CP x DP: the ranks holding these layers),
    each with the same MoE layers: b_e += rate * sign(mean load - load_e), the loads summed over the
    group, then the counts restart. Every rank applies the same update to the same fp32 bias."""
    routers = [r for r in routers if r.expert_bias is not None and r.training]
    if not routers:
        return
    loads = torch.stack([r.tokens_per_expert for r in routers]).double()  # (L, E), exact below 2^53
    if group is not None and group.size > 1:
        comm.all_reduce_(loads, group, "expert-bias")
    offset = loads.mean(-1, keepdim=True) - loads  # (L, E)
    for r, sign in zip(routers, torch.sign(offset).float()):
        r.expert_bias += sign * r.cfg.moe_router_bias_update_rate
        r.tokens_per_expert.zero_()
