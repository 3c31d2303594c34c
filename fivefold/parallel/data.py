"""Data parallelism: gradients summed over the DP (x CP) group in buckets, overlapped with backward.

Each rank computes, for its microbatches, the gradient of  sum(token losses) / N_global  where
N_global is the target-token count of the whole global batch (all ranks, all microbatches). Summing
these gradients over the group then gives exactly the gradient of the global per-token mean loss
  L = (sum over ranks r, microbatches m, tokens t of loss_rmt) / N_global,
not a mean of per-rank means (which would weight a rank's tokens by 1/its token count).

Gradients live in flat per-bucket buffers (`param.grad` is a view into one), so accumulation over
microbatches happens in place and a bucket is reduced with one collective. Buckets are filled in
reverse parameter order, the order backward produces gradients. On the last microbatch, a hook on
each parameter counts the bucket's gradients down; when a bucket is complete its all-reduce is
launched asynchronously, while backward continues with earlier layers. `finish()` waits for them.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fivefold.runtime import comm
from fivefold.runtime.mesh import Group

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bucket capacity in bytes of gradient (PyTorch DDP's default 25 MiB)."""


class _Bucket:
    def __init__(self, params: list[nn.Parameter], index: int):
        self.params, self.index = params, index
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)
        self.work = None


class GradReducer:
    """Bucketed, overlapped sum of gradients over `group` (the DP x CP group of a layout).

    Per step:  reducer.zero_grad();  for each microbatch m: reducer.prepare(last=(m is last)); backward;
    then reducer.finish() before reading gradients (clipping, optimizer step).
    """

    def __init__(self, params: Iterable[nn.Parameter], group: Group, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 tag: str = "dp-grad"):
        self.group, self.tag = group, tag
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        for p in reversed(self.params):
            if current and (p.dtype != current[0].dtype or
                            sum(q.numel() for q in current) * p.element_size() + p.nbytes > bucket_bytes):
                self.buckets.append(_Bucket(current, len(self.buckets)))
                current = []
            current.append(p)
        if current:
            self.buckets.append(_Bucket(current, len(self.buckets)))
        self._bucket_of = {}
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                self._bucket_of[p] = (b, v)
                p.grad = v
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._sync = False

    def zero_grad(self) -> None:
        """Zero every buffer and (re)point each `param.grad` at its view."""
        for b in self.buckets:
            b.buffer.zero_()
            for p, v in zip(b.params, b.views):
                p.grad = v

    def prepare(self, last: bool) -> None:
        """Call before each microbatch's backward: reduce during this backward only when `last`."""
        self._sync = last
        for b in self.buckets:
            b.pending, b.work = len(b.params), None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        b, view = self._bucket_of[p]
        if p.grad.data_ptr() != view.data_ptr():
            raise RuntimeError("a parameter's .grad was replaced; call GradReducer.zero_grad, not optimizer.zero_grad")
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        b.work = comm.all_reduce_async(b.buffer, self.group, tag=self.tag)

    def finish(self) -> None:
        """Launch the buckets whose parameters got no gradient (unused in this step), then wait for all."""
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
        self._sync = False
