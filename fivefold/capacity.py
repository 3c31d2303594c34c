"""Expert capacity (Megatron-Core's get_capacity), pure: the runtime's token dropping
(fivefold.model.capacity) and the planner's expert rows (fivefold.planner.memory.activations.routed_share)
both size experts by it.

One router call sees n tokens (a rank's tokens of one micro-batch) and makes n k assignments; with a
capacity factor c each of the E experts takes at most ceil(n k / E * c) of them, or, padded to
capacity, computes exactly that many rows (all n tokens when the capacity exceeds them).
"""
from __future__ import annotations

import math


def expert_capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Megatron-Core's get_capacity(num_tokens=tokens * topk, ...)."""
    return math.ceil(tokens * topk / num_experts * factor)


def padded_size(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Rows every expert computes with moe_pad_expert_input_to_capacity: its capacity, or all n
    tokens when the capacity exceeds them (Megatron's capacity mask is then all ones)."""
    return min(expert_capacity(tokens, topk, num_experts, factor), tokens)
