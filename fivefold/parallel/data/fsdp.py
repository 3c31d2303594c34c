"""ZeRO-3 (`--data-parallel-sharding-strategy optim_grads_params`, Megatron-FSDP / torch FSDP): the
parameters sharded over the DP x CP group too, gathered one unit at a time.

Units: the embedding, each decoder layer, the final norm with the output layer (a tied output layer
uses the embedding's unit as well); with MTP the final norm and the output layer are two units (MTP
calls the output layer, and the embedding, again) and each depth adds its layer (norms, projection,
decoder layer) and its final norm. Each unit is one gradient bucket (fivefold.parallel.data.reducer,
`units=`), laid out flat in `bucket.param_buffer` as under ZeRO-1; rank r keeps chunk r of it,
`bucket.param_shard`, persistently, and the full buffer's storage exists only while the unit is in use
(resized to 0 otherwise: every `param.data` view of it stays the same object, so autograd's saved
references to the weights are valid again once the unit is gathered — the FSDP1 technique).

Per microbatch:
  forward   a unit's forward pre-hook gathers it (all-gather of the chunks, tag dp-param) and starts
            the all-gather of the next unit (prefetch; not when a recompute runs the forward inside
            backward); its forward post-hook frees it, so a unit called again (a tied output layer,
            MTP's embedding and output layer) is gathered again;
  backward  a hook on the unit's output gradient gathers it again before its backward (and starts
            the all-gather of the unit before it, whose backward comes next); when its
            gradient bucket completes, the bucket is reduce-scattered (ZeRO-2, per microbatch) and the
            unit's parameters are freed.
So a rank holds, besides 1/d of everything, the unit in use, the prefetched one and the gradient
buffers of ZeRO-2. The optimizer steps the chunks (fivefold.parallel.data.distributed_optimizer reads
`param_shard`); nothing is all-gathered after the step: the next forward gathers. Checkpoints and
anything else that reads whole parameters use `full_params()`.
With MoE the routed experts are their own domain (reduced over expert-DP): a second ParamSharding over
the expert reducer, whose units are the MoE layers, gathers and frees them with their layer.
With pipeline parallelism (`reshard_after_forward=False`, TorchTitan's default policy under PP): a
unit is gathered by its first forward of the step and stays whole until the step's gradients are
reduced. A pipeline schedule interleaves the forwards and backwards (B and W passes) of many
microbatches on a stage, so freeing after each forward would gather every unit again per microbatch
and pass, with nothing to hide it behind; what ZeRO-3 still saves under PP is the parameters between
steps and the sharded main parameters, gradients' reduction and AdamW state. The units of a rank's
stages (VPP) are listed stage after stage.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from fivefold.parallel.data.reducer import GradReducer, _Bucket
from fivefold.runtime import comm


def units_of(model: nn.Module) -> list[tuple[list[nn.Module], list[nn.Parameter]]]:
    """(modules, parameters) per unit of a Decoder, or of a pipeline rank's stages (a StageStack:
    stage after stage), in forward order; each parameter in one unit."""
    decoders = list(model.stages.values()) if hasattr(model, "stages") else [model]
    groups = []
    for d in decoders:
        groups += ([[d.embedding]] if d.embedding is not None else []) + [[layer] for layer in d.layers.values()]
        if d.mtp is None:
            groups += [[m for m in (d.final_norm, d.head) if m is not None]] if d.head is not None else []
        else:  # fivefold.model.mtp calls the embedding and the head (not the final norm) again
            groups += [[d.final_norm], [d.head]]
            for mtp in d.mtp:
                groups += [[mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.layer], [mtp.final_norm]]
    seen: set[int] = set()
    out = []
    for modules in groups:
        params = [p for m in modules for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        out.append((modules, params))
    return out


class ParamSharding:
    """The gather / free cycle of ZeRO-3 over `reducer`'s buckets (one per unit of `model`).
    `reshard_after_forward=False` (pipeline parallelism): units stay whole from their first forward
    to the end of the step (see the module docstring)."""

    def __init__(self, model: nn.Module, reducer: GradReducer, tag: str = "dp-param", *,
                 reshard_after_forward: bool = True):
        self.reducer, self.group, self.tag = reducer, reducer.group, tag
        self.reshard_after_forward = reshard_after_forward
        bucket_of = {id(p): b for b in reducer.buckets for p in b.params}
        self.units: list[tuple[list[nn.Module], list[_Bucket]]] = []
        for modules, _ in units_of(model):
            # a module's buckets: of every parameter it uses that this reducer holds (a tied head uses
            # the embedding's too; with MoE the dense and the expert reducer each have a ParamSharding)
            buckets = list({id(bucket_of[id(p)]): bucket_of[id(p)] for m in modules for p in m.parameters()
                            if id(p) in bucket_of}.values())
            if buckets:
                self.units.append((modules, buckets))
        for b in reducer.buckets:
            lo, hi = reducer.shard_range(b)
            b.param_shard = b.param_buffer[lo:hi].clone()
            self._free(b)
        self._pending: dict[int, tuple[torch.Tensor, object]] = {}  # bucket index -> prefetched all-gather
        self._in_backward: set[int] = set()
        reducer.after_launch = self._free
        for i, (modules, _) in enumerate(self.units):  # a unit of several modules runs them in order
            modules[0].register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
            modules[-1].register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    @staticmethod
    def _free(b: _Bucket) -> None:
        b.param_buffer.untyped_storage().resize_(0)

    def _launch_gather(self, b: _Bucket) -> None:
        if b.param_buffer.untyped_storage().nbytes() == 0 and b.index not in self._pending:
            self._pending[b.index] = comm.all_gather(b.param_shard, 0, self.group, self.tag, async_op=True)

    def gather(self, b: _Bucket) -> None:
        """Make bucket b's parameters whole (completing a prefetch, or gathering now)."""
        if b.param_buffer.untyped_storage().nbytes() > 0 and b.index not in self._pending:
            return
        self._launch_gather(b)
        gathered, work = self._pending.pop(b.index)
        work.wait()
        b.param_buffer.untyped_storage().resize_(b.param_buffer.numel() * b.param_buffer.element_size())
        b.param_buffer.copy_(gathered)

    def _before_forward(self, i: int) -> None:
        for b in self.units[i][1]:
            self.gather(b)
        # prefetch the next unit while this one computes; not in a recompute inside backward, whose
        # next unit has had its backward (a gather there was never used: once a step under full recompute)
        if i + 1 < len(self.units) and i not in self._in_backward:
            for b in self.units[i + 1][1]:
                self._launch_gather(b)

    def _after_forward(self, i: int, out) -> None:
        if not self.reshard_after_forward or i in self._in_backward:  # recompute inside backward: the unit stays gathered for its backward
            return
        for b in self.units[i][1]:
            self._free(b)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._in_backward.add(i)
        for b in self.units[i][1]:
            self.gather(b)
        if i > 0:  # prefetch the unit whose backward comes next
            for b in self.units[i - 1][1]:
                self._launch_gather(b)

    def new_microbatch(self) -> None:
        """Before each microbatch: its forward frees every unit after use again."""
        self._in_backward.clear()

    def end_step(self) -> None:
        """After the step's backward and reduction: every unit freed, ready for the next forward."""
        self._in_backward.clear()
        for b in self.reducer.buckets:
            if b.index in self._pending:
                self._pending.pop(b.index)[1].wait()
            self._free(b)

    @contextlib.contextmanager
    def full_params(self, writes: bool = False):
        """Every parameter whole inside the block (checkpoints, evaluation tools); with `writes`, what
        the block wrote into the parameters becomes this rank's chunks afterwards."""
        for b in self.reducer.buckets:
            self.gather(b)
        try:
            yield
        finally:
            for b in self.reducer.buckets:
                if writes:
                    lo, hi = self.reducer.shard_range(b)
                    b.param_shard.copy_(b.param_buffer[lo:hi])
                self._free(b)
