"""Activation recompute, with Megatron-LM's meaning of its three knobs.

  granularity "full": a checkpointed span of decoder layers keeps only its input (b, s, h); backward
      runs the span's forward again (torch.utils.checkpoint, use_reentrant=False) to rebuild the rest.
      method "uniform": the module's layers are cut into consecutive spans of `num_layers` layers
          (the last may be shorter), every span checkpointed: all layers are recomputed and only
          every num_layers-th layer input is kept.
      method "block": the first `num_layers` layers of the module are checkpointed one by one; the
          others keep their activations (fewer recomputed layers, more memory).
      "The module" is one Decoder: a pipeline stage (each virtual stage under VPP), as Megatron's
      TransformerBlock is one model chunk.
  granularity "selective": only the core attention, softmax(q k^T / sqrt(d)) v, is recomputed
      (Megatron's default selective list, core_attn): q, k, v are kept, the attention's own saved
      tensors are dropped.
Recompute repeats the same operations on the same inputs, so losses and gradients are unchanged
(bit-exact in fp32 on CPU: tests/test_recompute.py).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

_state = threading.local()


def is_recomputing() -> bool:
    """True while backward reruns a checkpointed span's forward: state a forward accumulates once per
    micro-batch (the MoE router's expert load) must not count the rerun (as torch.is_grad_enabled,
    this is a property of the running thread, not of a model)."""
    return getattr(_state, "recomputing", False)


class _Recomputing:
    """Sets is_recomputing() inside. A class, not a @contextmanager: torch.utils.checkpoint enters the
    context that `context_fn` made once per rerun, and a split backward (input gradients, then weight
    gradients, as ZB-H1 runs them) reruns the span twice."""

    def __enter__(self) -> None:
        self.before = is_recomputing()
        _state.recomputing = True

    def __exit__(self, *exc) -> None:
        _state.recomputing = self.before


@dataclass(frozen=True)
class Recompute:
    granularity: str | None = None
    """None, "selective" or "full"."""
    method: str | None = None
    """With "full": "uniform" or "block"."""
    num_layers: int | None = None
    """With "full": layers per span (uniform) or checkpointed layers per module (block)."""

    @classmethod
    def from_training(cls, training) -> Recompute:
        """From a validated TrainingConfig's recompute_* fields (the combinations Megatron-LM refuses
        are refused by fivefold.config.rules before any rank starts)."""
        g, m, k = training.recompute_granularity, training.recompute_method, training.recompute_num_layers
        return cls(g, m if g == "full" else None, k if g == "full" else None)

    @property
    def core_attention(self) -> bool:
        """Selective: recompute the core attention of every layer."""
        return self.granularity == "selective"

    def spans(self, n: int) -> list[tuple[int, int, bool]]:
        """The module's n layers as consecutive (start, end, checkpointed) spans."""
        if self.granularity != "full":
            return [(0, n, False)] if n else []
        k = self.num_layers
        if self.method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        return [(i, i + 1, i < k) for i in range(n)]


def maybe_checkpoint(fn: Callable[..., torch.Tensor], on: bool, *args) -> torch.Tensor:
    """fn(*args), keeping only the inputs for backward (recomputing fn there) when `on` and grad is
    enabled. use_reentrant=False: works with inputs that do not require grad and with autocast."""
    if on and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), _Recomputing()))
    return fn(*args)
