"""Which attention heads a tensor-parallel rank holds (pure arithmetic, no torch).

a query heads, g KV heads (grouped-query attention: query head j reads KV head j // (a/g)), TP = t.
Query heads always split evenly: rank r holds heads [r a/t, (r+1) a/t).
  g >= t (g % t == 0): KV heads split too, rank r holds [r g/t, (r+1) g/t); every KV head lives on
      exactly one rank, and the query heads of rank r read only those (a/t is a multiple of a/g).
  t > g  (t % g == 0): a KV head cannot be split, so it is replicated on t/g ranks: rank r holds the
      single KV head r // (t/g), the one its query heads read (its a/t query heads are all inside
      the group of a/g heads that share it). Each replica's weight gradient covers only its own
      query heads; the true gradient is the sum over the t/g replicas (see layers.reduce_tp_grads).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSplit:
    q_heads: range
    """Query heads of this rank (global indices)."""
    kv_heads: range
    """KV heads of this rank (global indices)."""
    kv_replicas: int
    """How many TP ranks hold each of these KV heads (1 = split, t/g when replicated)."""


def split_heads(num_heads: int, kv_heads: int, tp: int, rank: int) -> HeadSplit:
    if num_heads % tp:
        raise ValueError(f"num_attention_heads={num_heads} must divide evenly over TP={tp}")
    if num_heads % kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} must be a multiple of the KV heads ({kv_heads})")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"KV heads ({kv_heads}) must be divisible by TP={tp} or TP divisible by them")
    if not 0 <= rank < tp:
        raise ValueError(f"TP rank {rank} is outside TP={tp}")
    per = num_heads // tp
    q = range(rank * per, (rank + 1) * per)
    if kv_heads >= tp:
        kv_per = kv_heads // tp
        return HeadSplit(q, range(rank * kv_per, (rank + 1) * kv_per), 1)
    replicas = tp // kv_heads
    kv = rank // replicas
    return HeadSplit(q, range(kv, kv + 1), replicas)
