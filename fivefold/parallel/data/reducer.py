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

With `shard=True` (Megatron's distributed optimizer, ZeRO-1) each bucket is padded to a multiple of
the group size n and reduce-scattered instead: rank r receives chunk r (a contiguous 1/n of the
bucket) of the summed gradient in `bucket.grad_shard`, and only that chunk is ever read (the full
`param.grad` views keep this rank's local sums). The parameters are moved into a flat buffer with
the same layout (`bucket.param_buffer`; `param.data` is a view into it), so that the optimizer can
step chunk r in place and one all-gather per bucket puts every rank's updated chunk back
(fivefold.parallel.data.distributed_optimizer). Call bytes per step: reduce-scatter = all-gather =
4 x (parameters rounded up to a multiple of n per bucket).

Mixed precision (fivefold.config.precision): the buffers hold the gradient dtype, which may differ
from the parameters' (bf16 parameters, fp32 gradients). Every parameter's buffer view is its
`main_grad` (Megatron's name). When the dtypes agree, `param.grad` is that view, as above; when they
differ, each gradient autograd produces (in the parameter's dtype) is added into `main_grad` by the
same hook, on every microbatch, and freed, so one parameter's 16-bit gradient lives at a time (the
grouped expert matmul adds its experts' stacked gradient in one operation, `add_stacked_grads`, and
counts them itself: autograd then accumulates nothing for them).
Code that accumulates gradients itself (the pipeline's weight-gradient pass) adds into
`grad_target(p)`.

ZeRO-2 (`per_microbatch=True`, with `shard=True`): a bucket is reduce-scattered after EVERY
microbatch whose backward completes it (when the caller prepares the microbatch to reduce), and its
chunk added into a persistent 1/n accumulator (`grad_shard`); the full-size bucket buffer is allocated
when backward produces the bucket's first gradient (each gradient is added into it by the hook, as for
16-bit parameters) and freed (its storage resized to 0) once its reduce-scatter is done, which is
waited for when the next bucket is launched. Between steps a rank holds 1/n of the gradients; during
backward, the buckets being filled and the one in flight (the last one of a microbatch is completed
before the next microbatch starts). Buckets not launched during a microbatch
(parameters it did not use, or a caller that reduces only in finish(), as for expert gradients)
keep their partial sums until finish() reduce-scatters them.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fivefold.config.precision import DEFAULT_BUCKET_BYTES
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


def grad_target(p: nn.Parameter) -> torch.Tensor | None:
    """Where p's gradient accumulates: its `main_grad` buffer view when a GradReducer holds it,
    else p.grad (None before the first gradient)."""
    return getattr(p, "main_grad", p.grad)


def add_stacked_grads(params: list[nn.Parameter], grads: torch.Tensor) -> bool:
    """Add `grads` (E, *shape), the gradients of the E `params` stacked, into their main_grad views in
    one operation where a GradReducer adds each of their gradients itself (a wider buffer, not ZeRO-2's
    transient ones) and the views lie evenly spaced in one buffer (an MoE layer's experts), and count
    them as their hooks would (Megatron's gradient-accumulation fusion: one kernel, not one per expert,
    and no per-expert accumulation by autograd). Returns whether it did; if so the caller hands autograd
    no gradient for `params` (their hooks, which autograd still calls, then find none and return)."""
    counts = [getattr(p, "_count_grad", None) for p in params]
    if len(params) < 2 or any(c is None for c in counts):
        return False
    views = [p.main_grad for p in params]
    if any(v.shape != grads.shape[1:] or not v.is_contiguous() for v in views):
        return False
    size = views[0].element_size()
    step, rest = (views[1].data_ptr() - views[0].data_ptr()) // size, range(2, len(views))
    if step == 0 or any(views[i].data_ptr() - views[i - 1].data_ptr() != step * size for i in rest) or \
            views[0].untyped_storage().data_ptr() != views[-1].untyped_storage().data_ptr():
        return False
    first, grads = (views[0], grads) if step > 0 else (views[-1], grads.flip(0))  # low address first
    stacked = first.as_strided((len(views), *first.shape), (abs(step), *first.stride()), first.storage_offset())
    stacked.add_(grads)
    for p, count in zip(params, counts):
        count(p)
    return True


class _Bucket:
    def __init__(self, params: list[nn.Parameter], index: int, pad_to: int = 1, dtype: torch.dtype | None = None):
        self.params, self.index = params, index
        self.numel = sum(p.numel() for p in params)
        padded = -(-self.numel // pad_to) * pad_to  # zeros past numel: the reduce-scatter needs n equal chunks
        self.buffer = torch.zeros(padded, dtype=dtype or params[0].dtype, device=params[0].device)
        self.offsets, self.views, offset = [], [], 0
        for p in params:
            self.offsets.append(offset)
            self.views.append(self.buffer[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)
        self.work = None
        self.param_buffer: torch.Tensor | None = None
        """shard mode: the parameters, flat, laid out like `buffer` (each param.data is a view)."""
        self.grad_shard: torch.Tensor | None = None
        """shard mode, after finish(): this rank's chunk of the summed gradient (buffer.numel() / n)."""

    @property
    def materialized(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    def materialize(self) -> None:
        """ZeRO-2: allocate the (freed) full-size buffer again, zeroed; every view of it is valid again."""
        if not self.materialized:
            self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
            self.buffer.zero_()

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)

    def share_params(self) -> None:
        """Move the parameters into one flat buffer laid out like the gradients (param.data -> a view)."""
        self.param_buffer = torch.zeros_like(self.buffer, dtype=self.params[0].dtype)
        for p, offset in zip(self.params, self.offsets):
            flat = self.param_buffer[offset: offset + p.numel()]
            flat.copy_(p.data.reshape(-1))
            p.data = flat.view_as(p)


class GradReducer:
    """Bucketed, overlapped sum of gradients over `group` (the DP x CP group of a layout).

    Per step:  reducer.zero_grad();  for each microbatch m: reducer.prepare(last=(m is last)); backward;
    then reducer.finish() before reading gradients (clipping, optimizer step).
    `shard=True`: reduce-scatter (see the module docstring); each bucket's `grad_shard` after finish().
    `per_microbatch=True` (with shard): ZeRO-2, reduce-scattered after every microbatch.
    """

    def __init__(self, params: Iterable[nn.Parameter], group: Group, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 tag: str = "dp-grad", shard: bool = False, grad_dtype: torch.dtype | None = None,
                 per_microbatch: bool = False, units: list[list[nn.Parameter]] | None = None,
                 replicate: Group | None = None):
        """`grad_dtype`: the buffers' dtype (default: the parameters'); see the module docstring.
        `units` (ZeRO-3): one bucket per unit (a decoder layer, ...), whatever its size, in reverse
        order, so that a bucket completes when its unit's backward has; default: by `bucket_bytes`.
        `replicate` (HSDP, with shard): `group` is this rank's shard group, and each reduced chunk is
        then all-reduced over the replicas of the chunk (the same place in every shard group)."""
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        if per_microbatch and not shard:
            raise ValueError("GradReducer(per_microbatch=True) is ZeRO-2: it needs shard=True")
        self.group, self.tag, self.shard, self.per_microbatch = group, tag, shard, per_microbatch
        self._inflight: list[tuple[_Bucket, torch.Tensor, object]] = []
        """ZeRO-2: (bucket, its chunk of the reduce-scatter, the work) not yet added in."""
        pad_to = group.size if shard else 1
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        if units is not None:
            for unit in reversed(units):
                self.buckets.append(_Bucket(list(reversed(unit)), len(self.buckets), pad_to, grad_dtype))
        for p in reversed(self.params if units is None else []):
            if current and (p.dtype != current[0].dtype or
                            sum(q.numel() for q in current) * p.element_size() + p.nbytes > bucket_bytes):
                self.buckets.append(_Bucket(current, len(self.buckets), pad_to, grad_dtype))
                current = []
            current.append(p)
        if current:
            self.buckets.append(_Bucket(current, len(self.buckets), pad_to, grad_dtype))
        self.after_launch = None
        """ZeRO-3: called with each bucket whose gradients were launched (its unit's parameters free)."""
        self._bucket_of = {}
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                self._bucket_of[p] = (b, v)
                p.main_grad = v
                # where the hook adds each gradient into v, add_stacked_grads may add and count them itself
                p._count_grad = self._count if v.dtype != p.dtype and not per_microbatch else None
                p.grad = self._grad_view(p, v)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            if shard:
                b.share_params()
            if per_microbatch:
                lo, hi = self.shard_range(b)
                b.grad_shard = b.buffer.new_zeros(hi - lo)
                b.free()
        self._sync = False

    def shard_range(self, b: _Bucket) -> tuple[int, int]:
        """[lo, hi) of bucket b's buffer that this rank owns in shard mode: chunk r of n."""
        chunk = b.buffer.numel() // self.group.size
        return self.group.rank * chunk, (self.group.rank + 1) * chunk

    def _grad_view(self, p: nn.Parameter, v: torch.Tensor) -> torch.Tensor | None:
        """What p.grad is between backwards: its buffer view, or None where the hook adds each gradient
        into the buffer (another dtype; ZeRO-2's buffers come and go)."""
        return v if v.dtype == p.dtype and not self.per_microbatch else None

    def zero_grad(self) -> None:
        """Zero every buffer (ZeRO-2: every accumulator) and (re)point each `param.grad` at its view."""
        for b in self.buckets:
            (b.grad_shard if self.per_microbatch else b.buffer).zero_()
            for p, v in zip(b.params, b.views):
                p.grad = self._grad_view(p, v)

    def prepare(self, last: bool) -> None:
        """Call before each microbatch's backward: reduce during this backward only when `last`."""
        self._drain()  # ZeRO-2: the last bucket of the previous microbatch, before its buffer fills again
        self._sync = last
        for b in self.buckets:
            b.pending, b.work = len(b.params), None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if p.grad is None:  # autograd got no gradient for p (add_stacked_grads added and counted it)
            return
        b, view = self._bucket_of[p]
        if view.dtype != p.dtype or self.per_microbatch:  # into the (wider, or ZeRO-2's) buffer, then freed
            b.materialize()
            view.add_(p.grad)
            p.grad = None
        elif p.grad.data_ptr() != view.data_ptr():
            raise RuntimeError("a parameter's .grad was replaced; call GradReducer.zero_grad, not optimizer.zero_grad")
        self._count(p)

    def _count(self, p: nn.Parameter) -> None:
        """p's gradient of this microbatch is in its bucket: reduce the bucket if it was the last one
        and this microbatch reduces."""
        if self._sync:
            b = self._bucket_of[p][0]
            b.pending -= 1
            if b.pending == 0:
                self._launch(b)

    def launch(self, b: _Bucket) -> None:
        """Reduce bucket b now if this microbatch has not yet (a caller that knows when a bucket is
        complete on every rank: the MoE layers' expert buckets, fivefold.parallel.data.data_parallel)."""
        if b.work is None:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        if self.per_microbatch:
            b.materialize()  # a bucket no gradient reached: zeros, so that every rank calls alike
            self._drain()  # one reduce-scatter in flight at a time: the previous bucket's buffer goes
            partial, b.work = comm.reduce_scatter(b.buffer, 0, self.group, self.tag, async_op=True)
            self._inflight.append((b, partial, b.work))
            if self.after_launch is not None:
                self.after_launch(b)
        elif self.shard:
            b.grad_shard, b.work = comm.reduce_scatter(b.buffer, 0, self.group, self.tag, async_op=True)
        else:
            b.work = comm.all_reduce_async(b.buffer, self.group, tag=self.tag)

    def finish(self) -> None:
        """Launch the buckets whose parameters got no gradient (unused in this step, or all of them
        under PP), at most two of those in flight at a time, then wait for all."""
        pending = [b for b in self.buckets if b.work is not None]  # launched during backward
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
                pending.append(b)
                if not self.per_microbatch and len(pending) > 2:  # (ZeRO-2 drains its own)
                    self._complete(pending.pop(0))
        if self.per_microbatch:
            self._drain()
        for b in pending:
            self._complete(b)
        if self.replicate is not None:  # HSDP: every instance's chunk summed (after the step's last
            for b in self.buckets:      # reduce-scatter; not overlapped with the backward)
                comm.all_reduce_(b.grad_shard, self.replicate, tag=self.tag)
        self._sync = False

    def _complete(self, b: _Bucket) -> None:
        b.work.wait()
        if self.shard and not self.per_microbatch:  # the chunk into the buffer's own range (as
            lo, hi = self.shard_range(b)          # Megatron): no second 1/n buffer between steps
            b.buffer[lo:hi].copy_(b.grad_shard)
            b.grad_shard = b.buffer[lo:hi]

    def _drain(self) -> None:
        """ZeRO-2: complete the in-flight reduce-scatters: add each chunk into its bucket's
        accumulator and free the bucket's full-size buffer."""
        for b, partial, work in self._inflight:
            work.wait()
            b.grad_shard.add_(partial)
            b.free()
        self._inflight = []
