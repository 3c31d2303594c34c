"""RL losses over per-token tensors (b, s) with a token mask, as verl / AReaL / SkyRL define them.

Every function takes the policy's per-token log-probs `logp` (with gradient), the tensors the
rollout produced, and `mask` (1 on response tokens that count). Losses are *sums* over this rank's
tokens divided by an explicit `denominator` (`aggregate`): the caller passes the global one (summed
over DP ranks and micro-batches), so any layout gives the one-process loss and gradient.

Aggregation modes (`aggregate`), with B sequences and T_i counted tokens in sequence i:
  token-mean            sum_i sum_t l_it / sum_i T_i            denominator: global token count
  seq-mean-token-sum    sum_i (sum_t l_it) / B                  denominator: global sequence count
  seq-mean-token-mean   sum_i (sum_t l_it / T_i) / B            denominator: global sequence count
(verl's `agg_loss` modes; GRPO's original objective is seq-mean-token-mean, DAPO's token-mean.)
"""
from __future__ import annotations

import torch

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float) -> torch.Tensor:
    """Sum of this rank's share of the loss under `mode`, divided by `denominator` (the global token
    count for token-mean, the global sequence count otherwise)."""
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / denominator
    sums = (per_token * mask).sum(-1)  # (b,)
    if mode == "seq-mean-token-sum":
        return sums.sum() / denominator
    if mode == "seq-mean-token-mean":
        return (sums / mask.sum(-1).clamp(min=1)).sum() / denominator
    raise ValueError(f"loss aggregation {mode!r}: one of {', '.join(MODES)}")


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised advantages: rewards (n,) of n / group_size prompts, each answered
    group_size times in a row; (r - mean of its group) / (std of its group + eps), std unbiased as
    torch.std (verl's default); `scale` False (Dr. GRPO) subtracts the mean only."""
    g = rewards.view(-1, group_size).float()
    centered = g - g.mean(-1, keepdim=True)
    if scale:
        centered = centered / (g.std(-1, keepdim=True) + eps)
    return centered.view(-1)


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                    behave_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token clipped surrogate loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp -
    old_logp); with `dual_clip` c > 1, for A < 0 the loss is capped at -c A (dual-clip PPO).
    `behave_weight`: per-token importance weights on the loss (truncated IS, decoupled PPO), no gradient."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    loss = torch.maximum(-ratio * adv, -ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    if behave_weight is not None:
        loss = loss * behave_weight.detach()
    return loss


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens (Schulman's estimators):
    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with log r = logp - ref_logp."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"KL estimator {estimator!r}: one of k1, k2, k3")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None = 0.2
               ) -> torch.Tensor:
    """Per-token critic loss 0.5 max((v - R)^2, (clip(v, v_old +- clip) - R)^2) (clip None: unclipped)."""
    loss = (values - returns).square()
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns).square())
    return 0.5 * loss


def truncated_is_weights(train_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling for the trainer / rollout engine mismatch: min(exp(train - rollout), cap)
    per token, no gradient (the correction multiplies the loss)."""
    return torch.exp(train_logp.detach() - rollout_logp).clamp(max=cap)


def decoupled_ppo_weights(proximal_logp: torch.Tensor, behave_logp: torch.Tensor, cap: float | None = None
                          ) -> torch.Tensor:
    """AReaL's decoupled PPO for rollouts k steps stale: the surrogate is clipped around the proximal
    policy (pass proximal_logp as `old_logp` to ppo_policy_loss) and weighted by exp(proximal - behaviour),
    the policy that sampled (capped at `cap`), no gradient."""
    w = torch.exp(proximal_logp - behave_logp).detach()
    return w if cap is None else w.clamp(max=cap)
