"""fivefold's pipeline executor vs torch.distributed.pipelining, schedule by schedule, side by side.

    python benchmarks/pp_schedules.py [--pp 2] [--microbatches 8] [--steps 4] [--layers 8] [--hidden 128]

Same Decoder stages (same init), microbatches, ranks (gloo, one thread each) for both. One step =
forward + backward of every microbatch (no optimizer). Twins: gpipe/ScheduleGPipe,
1f1b/Schedule1F1B, interleaved (VPP=2)/ScheduleInterleaved1F1B, dualpipev/ScheduleDualPipeV; zb-h1
has no single-stage twin there and is compared with our own 1f1b. Columns:
  step ms      median over --steps (after one warm-up step), barrier to barrier, ours / twin
  peak MiB     per rank, the most bytes of tensors allocated during one step alive at once
               (activations, gradients, receive buffers; parameters excluded), ours / twin
  bubble       ours, from the trace of one step: worst rank's measured idle fraction, next to the
               simulator's on the measured mean per-stage costs (uniform compute per stage)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

TWINS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "dualpipev": "ScheduleDualPipeV", "zb-h1": None}


class PeakTensorBytes(TorchDispatchMode):
    """Peak of live bytes over the storages created by ops run under this mode."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place result: no new storage (an alias of a tensor made before
            # the mode, e.g. autograd saving an input, would otherwise count that input as new)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = id(st)
                if key not in self.seen and st.nbytes():
                    self.seen.add(key)
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, key, st.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _config(args, name: str):
    from fivefold.config.schema import Config, ModelConfig, ParallelConfig, TrainingConfig
    return Config(model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4),
                  parallel=ParallelConfig(pipeline_model_parallel_size=args.pp, pipeline_schedule=name,
                                          virtual_pipeline_model_parallel_size=2 if name == "interleaved" else None),
                  training=TrainingConfig(seq_length=args.seq, micro_batch_size=args.mbs))


def _data(args):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (args.mbs, args.seq), generator=g) for _ in range(args.microbatches)]
    return ids, [torch.roll(i, -1, 1) for i in ids]


class _Twin(nn.Module):
    """A Decoder stage as torch.distributed.pipelining wants it: last stage returns fp32 vocab logits."""

    def __init__(self, stage, last: bool):
        super().__init__()
        self.stage, self.last = stage, last

    def forward(self, x):
        out = self.stage(x)
        return out[..., : self.stage.vocab_size].float() if self.last else out


def _timed(mesh, step, steps: int) -> list[float]:
    from fivefold.runtime import comm
    times = []
    for _ in range(steps + 1):
        comm.barrier(mesh.pp)
        t0 = time.perf_counter()
        step()
        comm.barrier(mesh.pp)
        times.append(time.perf_counter() - t0)
    return times[1:]


def timed_peak(step, iters: int, barrier) -> tuple[float, int, object]:
    """Run step() once to warm up, `iters` timed runs (each after barrier()), one under
    PeakTensorBytes: (median seconds, peak bytes, the warm-up run's result)."""
    out = step()
    times = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), _peak(step), out


def _peak(step) -> int:
    mode = PeakTensorBytes()
    with mode:
        step()
    return mode.peak


def _case(rank: int, world: int, args, name: str) -> dict:
    import torch.distributed.pipelining as tpp
    from fivefold.pipeline.simulate import simulate
    from fivefold.pipeline.stages import build_pipeline
    from fivefold.pipeline.trace import measured_result, stage_costs
    from fivefold.runtime.mesh import Mesh
    from fivefold.topology import Layout
    from fivefold.train.pipeline_step import gather_times

    mesh = Mesh.build(Layout(pp=args.pp))
    cpu = torch.device("cpu")
    m, tokens = args.microbatches, args.microbatches * args.mbs * args.seq
    ids, labels = _data(args)
    results = {}
    for impl in ("ours", "twin"):
        ours_name = "1f1b" if impl == "twin" and TWINS[name] is None else name
        pipe = build_pipeline(_config(args, ours_name), mesh, m, device=cpu)
        if impl == "ours" or TWINS[name] is None:
            def step(pipe=pipe, trace=False):
                return pipe.executor.run(ids, labels, loss_scale=1.0 / tokens, trace=trace)
        else:
            last = pipe.schedule.num_stages - 1
            stages = [tpp.PipelineStage(_Twin(pipe.stages[s], s == last), s, last + 1, cpu, group=mesh.pp.pg)
                      for s in sorted(pipe.stages)]
            cls = getattr(tpp, TWINS[name])

            def loss_fn(logits, y):
                return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / tokens
            sched = cls(stages if len(stages) > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn,
                        scale_grads=False)
            x, y = torch.cat(ids), torch.cat(labels)

            def step(sched=sched, pipe=pipe, x=x, y=y, last=last):
                first = 0 in pipe.stages
                sched.step(*([x] if first else []), target=y if last in pipe.stages else None, losses=[])
        times = _timed(mesh, step, args.steps)
        results[impl] = {"ms": 1e3 * statistics.median(times), "peak": _peak(step)}
        if impl == "ours":
            run = step(trace=True)
            measured = measured_result(pipe.schedule, gather_times(pipe, run, mesh))
            predicted = simulate(pipe.schedule, stage_costs(pipe.schedule, measured))
            results["bubble"] = (max(measured.bubble), max(predicted.bubble))
        for p in pipe.module.parameters():
            p.grad = None
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--schedules", default=",".join(TWINS))
    args = p.parse_args(argv)
    from fivefold.testing.harness import Workers

    pool = Workers(args.pp, timeout=600)
    print(f"PP={args.pp}, {args.microbatches} microbatches of {args.mbs}x{args.seq} tokens, Decoder "
          f"{args.layers} layers h={args.hidden}, gloo on CPU, {args.steps} timed steps")
    print(f"{'schedule':<12} {'twin':<24} {'step ms ours/twin':>20} {'ratio':>6}  {'peak MiB per rank ours/twin':<34}"
          f" {'bubble measured/simulated':>26}")
    try:
        for name in args.schedules.split(","):
            out = pool.run(_case, args, name)
            ours = max(r["ours"]["ms"] for r in out)
            twin = max(r["twin"]["ms"] for r in out)
            mem = " ".join(f"{r['ours']['peak'] / 2**20:.1f}/{r['twin']['peak'] / 2**20:.1f}"
                           f"({r['ours']['peak'] / max(1, r['twin']['peak']):.2f})" for r in out)
            measured, simulated = out[0]["bubble"]
            print(f"{name:<12} {TWINS[name] or 'ours 1f1b':<24} {ours:>9.1f}/{twin:<9.1f} {ours / twin:>6.2f}  "
                  f"{mem:<34} {measured:>12.1%}/{simulated:<.1%}", flush=True)
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
