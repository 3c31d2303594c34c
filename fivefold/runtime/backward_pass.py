"""What the running backward pass computes, for custom autograd functions that can skip work.

A zero-bubble schedule splits a stage's backward into B (input gradients only) and W (weight
gradients only, from the gradients B recorded; fivefold.pipeline.backward). A custom function that
computes both in one backward (the TP column-parallel linear: dX and its collective, dW and the
gathered input it needs) does the other half for nothing in each unless it asks what the pass wants:
`weight_grads_wanted()` (False inside B) and `input_grad_wanted(ctx, i)` (whether the graph task
reaches input i's producer: False in W, whose walk starts at the joins and ends at the weights).
"""
from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()


@contextlib.contextmanager
def input_grads_only():
    """B: the backward run inside computes input gradients only."""
    before = getattr(_state, "input_only", False)
    _state.input_only = True
    try:
        yield
    finally:
        _state.input_only = before


def weight_grads_wanted() -> bool:
    """False inside `input_grads_only` (B); True in any other backward."""
    return not getattr(_state, "input_only", False)


def input_grad_wanted(ctx, i: int) -> bool:
    """Whether the running backward uses the gradient of forward input i of the custom function whose
    backward `ctx` is: it requires grad and the graph task will run the node it flows into. (torch
    cannot tell for a leaf while `autograd.grad` runs: a leaf input counts as wanted.)"""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    if type(node).__name__ == "AccumulateGrad":
        return True
    return torch._C._will_engine_execute_node(node)
