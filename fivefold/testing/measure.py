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
from fivefold.planner.measured.versus import BOOKKEEPING_TAGS
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


class _NoModuleHooks:
    """Stands in for MemTracker's ModTracker: no per-module hooks. Those hooks give per-module
    statistics (not read here), refuse a root module's second forward (gradient accumulation and
    pipeline schedules run one per microbatch) and register multi-grad hooks on module inputs that
    fail under the pipeline's autograd.grad on leaf stage inputs. Without them every tensor that is
    not a parameter, gradient or optimizer state counts as "Activation" (forward or backward alike)."""

    is_bw = False
    parents = {"Global"}

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


def _tracker():
    """torch's MemTracker (a TorchDispatchMode that sees every storage an op allocates and a
    weakref callback when it is freed), without module hooks (`_NoModuleHooks`): only its global
    peak and its split into parameters / gradients / optimizer state / the rest are read."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker._mod_tracker = _NoModuleHooks()
    return tracker


def measure_forward(rank: int, world: int, config: Config, chunk: int = 1024) -> RankMeasurement:
    """Harness case: a forward-only model (an RL reference) as our runtime runs it: `Engine.forward`
    (no_grad; per-token log-probs and entropy from the last hidden states in sequence chunks of `chunk`
    tokens; under PP the forward-only pipeline) on this DP rank's share of the config's global batch in
    micro-batches of `micro_batch_size`, once to warm up, then measured. The engine is frozen
    (`Engine(frozen=True)`): its weights alone, no gradient buffers or optimizer state, every tensor it
    holds tracked."""
    from fivefold.engine import Batch, Engine

    t = config.training
    ctx = RankContext(Mesh.build(layout_of(config)), Path("."))
    engine = Engine(config, ctx, chunk=chunk, frozen=True)
    n = t.global_batch_size // ctx.dp_size
    gen = torch.Generator().manual_seed(t.seed * 1000 + ctx.dp_rank)
    ids = torch.randint(0, config.model.vocab_size, (n, t.seq_length), generator=gen)
    batch = Batch(ids, torch.ones(n, t.seq_length))
    engine.forward(batch, micro_batch_size=t.micro_batch_size)
    traffic.reset()
    tracker = _tracker()
    tracker.track_external(engine.model)
    with tracker:
        stats = engine.forward(batch, micro_batch_size=t.micro_batch_size)
    snap = {getattr(k, "value", k): v for k, v in tracker.get_tracker_snapshot("peak").get(ctx.device, {}).items()}
    tags = {tag for _, tag, _, _, _ in traffic.table()}
    return RankMeasurement(
        rank=rank, coords=dict(ctx.mesh.coords),
        bytes_by_tag={tag: traffic.bytes(tag=tag) for tag in sorted(tags)},
        calls_by_tag={tag: traffic.calls(tag=tag) for tag in sorted(tags)},
        peak_bytes=int(snap.get("Total", 0)),
        peak_by_kind={k: int(v) for k, v in snap.items() if k != "Total"},
        loss=float(stats.logprobs.mean()))


def measure_step(rank: int, world: int, config: Config) -> RankMeasurement:
    """Harness case: build the config's model on this rank as `train` does (fivefold.train.loop.build),
    take a warm-up step, then measure one (`train_step`, with PP > 1 through the pipeline schedule)."""
    t = config.training
    ctx = RankContext(Mesh.build(layout_of(config)), Path("."))  # out_dir: nothing is written
    parts = build(config, ctx)
    mesh, device = ctx.mesh, ctx.device

    def step(i: int):
        batch = synthetic_batch(config, i, ctx.dp_rank, ctx.dp_size)
        return train_step(parts, batch, lr=t.lr, clip_grad=t.clip_grad, device=device)

    step(0)
    traffic.reset()
    tracker = _tracker()
    # the data-parallel mode's buffers and main parameters as "Other" (a 16-bit run's fp32 gradient
    # buffers and copies; tensors created before the tracker are invisible to it otherwise), then the
    # model and the AdamW(s) it steps, whose kinds replace "Other" where they share a storage
    tracker.track_external(*parts.dp.held_tensors())
    tracker.track_external(parts.model, *parts.dp.optimizers)
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
