"""Megatron's distributed optimizer (ZeRO-1): optimizer state sharded over the DP x CP group.

Layout (GradReducer(shard=True)): each gradient bucket of the flat buffer, padded to a multiple of n
(the DP x CP size), is cut into n contiguous chunks; rank r owns chunk r of every bucket. One step:
  1. backward: each bucket's gradients are reduce-scattered as soon as they are complete (tag
     dp-grad), so rank r holds g_r = chunk r of sum_q g_q  (1/n of the gradient);
  2. global norm ||g|| = sqrt(sum over ranks of sum(g_r^2)): the chunks partition every parameter,
     so the squares are added over the DP x CP group and then over the model-parallel group, which
     gives exactly the norm of the non-sharded step; clip g_r;
  3. AdamW steps chunk r only: the parameters' chunk (fp32, in place in the flat parameter buffer)
     and its moments exp_avg, exp_avg_sq: 1/n of the non-sharded optimizer state per rank;
  4. all-gather of each bucket's updated chunks (tag dp-param) back into the flat parameter buffer.
Call bytes per step: 4 x P' for the reduce-scatter and 4 x P' for the all-gather (P' = parameters,
each bucket rounded up to a multiple of n), against 4 x P for the all-reduce without ZeRO.

A parameter that straddles a chunk boundary is split into pieces, each a leaf tensor aliasing its
range of the parameter buffer, put in the weight-decay group of its parameter (Megatron's
per-parameter ranges of a shard). AdamW with foreach=False is elementwise, so a piece gets the same
numbers as its parameter stepped whole. With fp32 parameters the parameter chunk is itself the main
copy (no second copy, as Megatron); with 16-bit parameters (or offload) each piece has an fp32 main
copy that AdamW steps and that is cast back into the parameter buffer before the all-gather, which then
moves 2-byte parameters (fivefold.parallel.data.main_params.MainParams). The reduced chunk's gradients are in
the gradient dtype (fp32 or 16-bit: GradReducer(grad_dtype)).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.parallel.optimizer import OptimShard
from fivefold.config.schema import TrainingConfig
from fivefold.parallel.data.reducer import GradReducer
from fivefold.runtime import comm
from fivefold.parallel.param_meta import ParamMeta, metas_of
from fivefold.parallel.optimizer import build_adamw
from fivefold.parallel.data.main_params import MainParams
from fivefold.config.precision import Precision


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that this rank's chunk of a bucket covers."""

    name: str
    """The parameter's name in model.named_parameters()."""
    param: nn.Parameter
    """The whole (local) parameter."""
    flat: tuple[int, int]
    """[lo, hi) in param.view(-1)."""
    tensor: nn.Parameter
    """What AdamW steps: a leaf aliasing param.view(-1)[lo:hi] in the flat parameter buffer (fp32
    parameters), or an fp32 main copy of that range (16-bit parameters, offload)."""
    bucket: int
    grad_range: tuple[int, int]
    """[lo, hi) of this piece in the bucket's reduced chunk (bucket.grad_shard)."""


class DistributedOptimizer:
    """AdamW over this rank's chunks of the parameters; `param_groups` and `state` as torch.optim's.

    Per step, after reducer.finish(): clip the gradients of `main_params()` by the global norm
    (fivefold.parallel.data.data_parallel.DataParallel.clip_grads adds this optimizer's `group`), then `step()`."""

    def __init__(self, model: nn.Module, reducer: GradReducer, training: TrainingConfig, *, tag: str = "dp-param",
                 precision: Precision | None = None):
        if not reducer.shard:
            raise ValueError("DistributedOptimizer needs GradReducer(shard=True): gradients reduce-scattered")
        self.reducer, self.group, self.tag = reducer, reducer.group, tag
        names = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
        model_metas = metas_of(model)
        spans = []  # (bucket, param, [start, end) in the bucket)
        for i, b in enumerate(reducer.buckets):
            lo, hi = reducer.shard_range(b)
            for p, offset in zip(b.params, b.offsets):
                start, end = max(lo, offset), min(hi, offset + p.numel())
                if start < end:
                    spans.append((i, p, offset, start, end, lo))
        # ZeRO-3 (fivefold.parallel.data.fsdp) keeps the chunk in its own tensor, the full buffer freed
        ranges = [nn.Parameter(reducer.buckets[i].param_shard[start - lo: end - lo]
                               if getattr(reducer.buckets[i], "param_shard", None) is not None
                               else reducer.buckets[i].param_buffer[start:end]) for i, _, _, start, end, lo in spans]
        self.mains = MainParams(ranges, precision or Precision.of(training))  # leaves sharing the buffer's storage
        self.pieces: list[Piece] = [Piece(names[id(p)], p, (start - offset, end - offset), main, i, (start - lo, end - lo))
                                    for (i, p, offset, start, end, lo), main in zip(spans, self.mains.mains)]
        self.metas: dict[int, ParamMeta] = {id(pc.tensor): model_metas[id(pc.param)] for pc in self.pieces}
        """id(piece.tensor) -> its parameter's metadata: a main parameter is held as its parameter is."""
        self.optimizer = build_adamw([pc.tensor for pc in self.pieces if pc.param.ndim >= 2],
                                     [pc.tensor for pc in self.pieces if pc.param.ndim < 2], training)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        """AdamW's state, keyed by each piece's `tensor`."""
        return self.optimizer.state

    def attach_grads(self) -> None:
        """Each piece's .grad: its range of the reduced chunk (after reducer.finish())."""
        grads = []
        for pc in self.pieces:
            shard = self.reducer.buckets[pc.bucket].grad_shard
            if shard is None:
                raise RuntimeError("DistributedOptimizer: call reducer.finish() before reading the gradients")
            grads.append(shard[pc.grad_range[0]: pc.grad_range[1]])
        self.mains.attach(grads)

    def main_params(self, of: Iterable[nn.Parameter] | None = None) -> list[nn.Parameter]:
        """This rank's pieces of the parameters `of` (default all), each holding its reduced gradient
        chunk as .grad (after attach_grads()): what clipping reads and step() updates. A piece
        is held as its parameter is (`metas`), so TP gradient completion and norm ownership apply to
        it as to the parameter (every TP rank's buffer has the same layout, so the same ranges)."""
        ids = None if of is None else {id(p) for p in of}
        return [pc.tensor for pc in self.pieces if ids is None or id(pc.param) in ids]

    def step(self) -> None:
        """AdamW on this rank's chunks (their main copies cast back), then every bucket's chunks
        all-gathered into the parameters."""
        self.optimizer.step()
        self.mains.write_back()
        in_flight = []  # at most two all-gathers: each output is a bucket's full size
        for b in self.reducer.buckets:
            if getattr(b, "param_shard", None) is not None:
                continue  # ZeRO-3: the next forward gathers
            lo, hi = self.reducer.shard_range(b)
            in_flight.append((b, *comm.all_gather(b.param_buffer[lo:hi], 0, self.group, self.tag, async_op=True)))
            if len(in_flight) == 2:
                _land(*in_flight.pop(0))
        for gather in in_flight:
            _land(*gather)

    def optim_shards(self) -> list[OptimShard]:
        """What this rank's state covers, for checkpoints: each piece's range of its parameter."""
        return [OptimShard(pc.name, pc.tensor, pc.flat) for pc in self.pieces]


def _land(b, gathered: torch.Tensor, work) -> None:
    """Wait for bucket b's all-gather; `gathered` (buffer numel,) = every rank's chunk in rank order."""
    work.wait()
    if gathered.data_ptr() != b.param_buffer.data_ptr():
        b.param_buffer.copy_(gathered)
