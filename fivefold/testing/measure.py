"""Measure one training step of a canonical Config through the real runtime, per rank: bytes
communicated by tag, and peak tensor memory by kind. The planner's estimates are judged against it
(`fivefold.planner.measured`, benchmarks/planner_vs_measured.py, tests/test_planner_measured.py).

Run as a harness case:  `Workers(n).run(measure_step, config)`  -> one `RankMeasurement` per rank.

What is measured:
  - traffic: `fivefold.runtime.traffic` call bytes (the full tensor a collective produces or
    consumes) by tag, for the measured step only ("dp-grad", "tp", "sp", "pp", ... are model
    communication; "loss", "grad-norm", "metrics" are bookkeeping);
  - memory: torch's `MemTracker` (torch.distributed._tools.mem_tracker), a TorchDispatchMode that
    sees every tensor storage an op allocates and a weakref callback when it is freed, so its peak
    is the peak of live tensor bytes, split into parameters, gradients, optimizer state, forward
    activations and backward temporaries. It is exact for tensors (no allocator rounding on CPU)
    and blind to the interpreter and libraries, which is what the planner's tensor terms describe;
    process RSS (VmHWM) would add ~0.4 GB of Python and torch that no tensor model predicts.

The step measured is the second: AdamW allocates its moments lazily in the first `step()`, so the
first step never holds activations and optimizer state at once; every later step does. Data are
uniform random token ids, packed (every position a target), so the step's shapes are exactly the
config's (b = micro_batch_size, s = seq_length) whatever the tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fivefold.config.schema import Config
from fivefold.config.validate import layout_of
from fivefold.data.loader import StepBatch, collate
from fivefold.data.sampler import even_share
from fivefold.errors import NotImplementedYet
from fivefold.parallel.data import GradReducer
from fivefold.planner.versus import BOOKKEEPING_TAGS
from fivefold.runtime import traffic
from fivefold.runtime.mesh import Mesh
from fivefold.train.context import RankContext
from fivefold.train.loop import build
from fivefold.train.step import train_step



@dataclass
class RankMeasurement:
    rank: int
    coords: dict[str, int]
    """This rank's coordinates in the layout (tp, cp, dp, pp)."""
    bytes_by_tag: dict[str, int] = field(default_factory=dict)
    """Call bytes of the measured step by traffic tag."""
    calls_by_tag: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    """Peak live tensor bytes during the measured step (MemTracker)."""
    peak_by_kind: dict[str, int] = field(default_factory=dict)
    """The live bytes at that peak by MemTracker kind (Parameter, Gradient, Optstate, Activation, Temp, ...)."""
    loss: float = 0.0

    @property
    def model_bytes(self) -> int:
        """Call bytes of model communication (every tag but the bookkeeping ones)."""
        return sum(v for k, v in self.bytes_by_tag.items() if k not in BOOKKEEPING_TAGS)


def synthetic_batch(config: Config, step: int, dp_rank: int, dp_size: int) -> StepBatch:
    """This DP rank's microbatches of global batch `step`: random ids in [0, vocab), every label a target."""
    t = config.training
    gen = torch.Generator().manual_seed(t.seed * 1000 + step)
    tokens = torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_length + 1), generator=gen)
    share = even_share(t.global_batch_size, dp_rank, dp_size)  # as BatchLoader splits packed samples
    mine = tokens[share]
    micro = [collate(list(mine[k: k + t.micro_batch_size])) for k in range(0, len(mine), t.micro_batch_size)]
    return StepBatch(micro, t.global_batch_size * t.seq_length, np.arange(share.start, share.stop))


class _Reducer(GradReducer):
    """The runtime's GradReducer, also telling the MemTracker (when set) that a microbatch starts:
    MemTracker refuses a module's second forward unless its per-module stats are reset (its global
    peak, which is what is read here, is kept)."""

    tracker = None

    def prepare(self, last: bool) -> None:
        if self.tracker is not None:
            self.tracker.reset_mod_stats()
        super().prepare(last)


def measure_step(rank: int, world: int, config: Config) -> RankMeasurement:
    """Harness case: build the config's model on this rank as `train` does (fivefold.train.loop.build),
    take a warm-up step, then measure one. PP = 1 only (a pipeline schedule runs stages, not `train_step`)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    t = config.training
    ctx = RankContext(Mesh.build(layout_of(config)), Path("."))  # out_dir: nothing is written
    if ctx.layout.pp > 1:
        raise NotImplementedYet("measure_step: pipeline parallelism (PP > 1) is not measured")
    parts = build(config, ctx, reducer_cls=_Reducer)
    model, optimizer, reducer, mesh, device = parts.model, parts.optimizer, parts.reducer, ctx.mesh, ctx.device

    def step(i: int):
        return train_step(model, optimizer, reducer, synthetic_batch(config, i, ctx.dp_rank, ctx.dp_size),
                          lr=t.lr, clip_grad=t.clip_grad, precision=t.precision, dp_group=ctx.dp_group,
                          model_parallel_group=ctx.model_parallel_group, tp_group=mesh.tp, device=device)

    step(0)
    traffic.reset()
    tracker = MemTracker()
    tracker.track_external(model, getattr(optimizer, "optimizer", optimizer))  # ZeRO-1: the AdamW it wraps
    reducer.tracker = tracker
    with tracker:
        result = step(1)
    snap = {getattr(k, "value", k): v for k, v in tracker.get_tracker_snapshot("peak").get(device, {}).items()}
    tags = {tag for _, tag, _, _, _ in traffic.table()}
    return RankMeasurement(
        rank=rank, coords=dict(mesh.coords),
        bytes_by_tag={tag: traffic.bytes(tag=tag) for tag in sorted(tags)},
        calls_by_tag={tag: traffic.calls(tag=tag) for tag in sorted(tags)},
        peak_bytes=int(snap.get("Total", 0)),
        peak_by_kind={k: int(v) for k, v in snap.items() if k != "Total"},
        loss=result.loss)
