"""Dropout with layout-independent masks (Megatron's --attention-dropout / --hidden-dropout).

Megatron draws masks from per-rank CUDA generators (its RNG tracker), so a different TP / CP / PP / DP
layout drops different elements. Here every mask element is a counter-based hash of
    (seed, step, sample, layer, site, global token position, feature)          [hidden dropout]
    (seed, step, sample, layer, global head, query position, key position)     [attention dropout]
kept when the 32-bit hash is >= p * 2^32, and kept values scaled by 1/(1-p). The sample is the
micro-batch row's index in the dataset, positions are global within the sequence, heads and
features are global indices: whichever rank holds an element draws the same bit for it, so every
layout (and a recomputed forward) equals one process. Masks are never stored beyond autograd's.

The hash is Wellons' 32-bit "lowbias" mixer with multipliers < 2^31, so it runs exactly in int64 on
any device (products stay below 2^63), folded over the coordinates: x <- mix(x ^ mix(c)).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF
EMBEDDING, ATTENTION_OUT, MLP_OUT, PROBS = range(4)
"""Sites: where in a layer (or the embedding) a mask is drawn."""


def _mix(x):
    """32 bits -> 32 well-mixed bits, on ints or int64 tensors (values < 2^32, products < 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x46CA68B5) & M32
    return x ^ (x >> 16)


def keep_mask(key: Sequence[int], coords: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Bool mask, True = keep, shaped as the broadcast of `coords` (int64 tensors of global
    indices): hash of the scalar `key` parts, then of each coordinate in turn."""
    base = 0x9E3779B9
    for part in key:
        base = _mix(base ^ _mix(int(part) & M32))
    x = torch.tensor(base, dtype=torch.int64, device=coords[0].device)
    for c in coords:
        x = _mix(x ^ _mix(c & M32))
    return x >= int(p * 2 ** 32)


@dataclass(frozen=True)
class DropoutKey:
    """What one micro-batch's masks depend on besides the model's seed: the optimizer step and the
    dataset index of each row. Passed to Decoder.forward / loss (training only)."""
    step: int
    samples: torch.Tensor
    """(b,) int64."""


@dataclass(frozen=True)
class Noise:
    """One forward's dropout on this rank: rates, key, and the global coordinates it holds."""
    seed: int
    key: DropoutKey
    hidden_p: float
    attention_p: float
    positions: torch.Tensor
    """(s,) global token positions of the sequence attention sees (this CP rank's)."""
    hidden_positions: torch.Tensor
    """(s',) those of the residual stream rows this rank holds (SP: its s/tp slice)."""

    def hidden(self, x: torch.Tensor, layer: int, site: int) -> torch.Tensor:
        """x (b, s', h) with hidden dropout: element (sample, position, feature) of (layer, site)."""
        if self.hidden_p == 0:
            return x
        samples = self.key.samples.to(x.device).view(-1, 1, 1)
        feats = torch.arange(x.shape[-1], device=x.device).view(1, 1, -1)
        keep = keep_mask((self.seed, self.key.step, layer, site), [samples, self.hidden_positions.view(1, -1, 1).to(x.device), feats],
                         self.hidden_p)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.hidden_p))

    def probs(self, probs: torch.Tensor, layer: int, heads: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """Attention probabilities (b, a', s, s_k) of global heads `heads` (a',), queries at
        self.positions and keys at global `k_positions` (s_k,), with dropout."""
        if self.attention_p == 0:
            return probs
        dev = probs.device
        keep = keep_mask((self.seed, self.key.step, layer, PROBS),
                         [self.key.samples.to(dev).view(-1, 1, 1, 1), heads.to(dev).view(1, -1, 1, 1),
                          self.positions.to(dev).view(1, 1, -1, 1), k_positions.to(dev).view(1, 1, 1, -1)],
                         self.attention_p)
        return probs * keep.to(probs.dtype) * (1.0 / (1.0 - self.attention_p))


def dropped(noise: Noise | None, x: torch.Tensor, layer: int, site: int) -> torch.Tensor:
    """x with hidden dropout when this forward has noise, else x."""
    return x if noise is None else noise.hidden(x, layer, site)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, docs, drop,
                       q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scale + causal [+ documents]) with `drop` applied to the probabilities, times v:
    q (b, a, s_q, d), k/v (b, g, s_k, d) -> (b, a, s_q, d); queries and keys at global positions
    q_pos (s_q,) and k_pos (s_k,) (under CP: this rank's chunks, and the whole gathered sequence).
    The probabilities are materialised (what the fused kernels avoid): used only with attention dropout."""
    a, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(a // g, dim=1), v.repeat_interleave(a // g, dim=1)  # query head i reads KV i // (a/g)
    scores = (q @ k.transpose(-1, -2)).float() * scale  # (b, a, s_q, s_k)
    q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    allowed = k_pos.view(1, -1) <= q_pos.view(-1, 1)  # (s_q, s_k) causal
    if docs is not None:  # each document attends only to itself
        cuts = [torch.tensor(c[1:-1], device=q.device, dtype=torch.int64) for c in docs.bounds]
        doc_q = torch.stack([torch.searchsorted(c, q_pos, right=True) for c in cuts])  # (b, s_q)
        doc_k = torch.stack([torch.searchsorted(c, k_pos, right=True) for c in cuts])  # (b, s_k)
        allowed = allowed & (doc_q[:, None, :, None] == doc_k[:, None, None, :])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(q.dtype)
    return drop(probs) @ v  # (b, a, s_q, d)
