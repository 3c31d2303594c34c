"""Data-parallel modes and precisions side by side, with torch's FSDP2 (`fully_shard`) beside ours.

    python benchmarks/dp_modes.py              # DP=2, a ~10M-parameter Llama-style model, seq 256
    python benchmarks/dp_modes.py --dp 4 --steps 3

For each mode (replicate, ZeRO-1, ZeRO-2, ZeRO-3) and precision (fp32, bf16) one step is measured on the
harness (`fivefold.testing.measure.measure_step`, the step `train` runs) after a warm-up step:
  - model state per rank: parameters + gradient buffers + main parameters + AdamW moments, counted
    from the live tensors after the step, against the formula (fivefold.config.precision,
    docs/precision.md) times the parameters;
  - peak tensor memory of the step (MemTracker) against the planner's estimate;
  - bytes communicated by the data-parallel collectives (dp-grad, dp-param) against the planner's
    derived count (fivefold.planner.time.layer_collectives);
  - median step time over `--steps` steps.
FSDP2: `fully_shard` on every decoder layer and on the model (our Decoder, fp32 or bf16 parameters
with fp32 reduction via MixedPrecisionPolicy), AdamW, the same batches; its peak from MemTracker, its
bytes derived (FSDP2's collectives bypass our counters: per step an all-gather of the parameters in
forward and again in backward, a reduce-scatter of the gradients). gloo on CPU, 1 thread per rank.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.config.schema import ClusterConfig, Config, ModelConfig, TrainingConfig  # noqa: E402

MiB = 2**20
MODEL = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=8192)
MODES = [("replicate", {}), ("ZeRO-1", {"use_distributed_optimizer": True}),
         ("ZeRO-2", {"data_parallel_sharding_strategy": "optim_grads"}),
         ("ZeRO-3", {"data_parallel_sharding_strategy": "optim_grads_params"})]


def config(dp: int, precision: str, mode: dict) -> Config:
    return Config(cluster=ClusterConfig(num_nodes=1, gpus_per_node=dp, world_size=dp), model=replace(MODEL),
                  training=TrainingConfig(seq_length=256, global_batch_size=4 * dp, micro_batch_size=2,
                                          precision=precision, **mode))


def ours(rank: int, world: int, cfg: Config, steps: int) -> dict:
    """Measured step (peak, bytes) + model-state bytes + step times of our runtime."""
    import torch

    from fivefold.runtime.mesh import Mesh
    from fivefold.config.validate import layout_of
    from fivefold.testing.measure import measure_step, synthetic_batch
    from fivefold.train.context import RankContext
    from fivefold.train.loop import build
    from fivefold.train.step import train_step

    m = measure_step(rank, world, cfg)
    ctx = RankContext(Mesh.build(layout_of(cfg)), Path("."))
    parts = build(cfg, ctx)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        train_step(parts, synthetic_batch(cfg, i, ctx.dp_rank, ctx.dp_size), lr=1e-3, clip_grad=1.0, device=ctx.device)
        times.append(time.perf_counter() - t0)
    storages = {}
    tensors = [p for p in parts.model.parameters()] + [p.main_grad for p in parts.model.parameters()]
    for d in parts.dp.domains:
        tensors += d.main() + [b.grad_shard for b in d.reducer.buckets]
        tensors += [getattr(b, "param_shard", None) for b in d.reducer.buckets]
    tensors += [v for s in parts.dp.state.values() for k, v in s.items() if k != "step"]
    for t in tensors:
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return {"peak": m.peak_bytes, "bytes": {k: v for k, v in m.bytes_by_tag.items() if k.startswith("dp-")},
            "state": sum(storages.values()), "params": sum(p.numel() for p in parts.model.parameters()),
            "time": statistics.median(times[1:]), "rank": rank, "pp_rank": m.coords["pp"], "cfg": cfg,
            "kinds": m.peak_by_kind}


def fsdp2(rank: int, world: int, cfg: Config, steps: int) -> dict:
    """The same model, batches and AdamW under torch's fully_shard."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from fivefold.model import Decoder
    from fivefold.testing.measure import _tracker, synthetic_batch

    t = cfg.training
    model = Decoder(cfg.model, seed=t.seed)  # the plain model: FSDP2 shards it
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if t.precision == "bf16" else None,
                                  reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "loss")  # the step calls Decoder.loss, not forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step(i: int):
        batch = synthetic_batch(cfg, i, rank, world)
        for mb in batch.microbatches:
            total, _ = model.loss(mb.input_ids, mb.labels)
            (total / batch.global_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step(0)
    tracker = _tracker()
    tracker.track_external(model, opt)
    with tracker:
        step(1)
    peak = int(tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).get("Total", 0))
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(2 + i)
        times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())  # DTensors: the global count
    p_bytes = 2 if t.precision == "bf16" else 4
    n_mb = len(synthetic_batch(cfg, 0, rank, world).microbatches)
    derived = {"all-gather (fwd + bwd)": 2 * n_mb * p_bytes * n, "reduce-scatter": n_mb * 4 * n}
    return {"peak": peak, "bytes": derived, "time": statistics.median(times), "params": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from fivefold.config.precision import Precision
    from fivefold.planner.measured.callbytes import call_bytes
    from fivefold.planner.layout import Plan
    from fivefold.planner.memory.kinds import CPU_EAGER
    from fivefold.planner.memory.peak import memory_per_rank
    from fivefold.testing.harness import Workers

    print(f"DP={args.dp}, {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, vocab {MODEL.vocab_size}, "
          "seq 256, 2 microbatches of 2 per rank; gloo on CPU\n")
    print("| runtime | precision | mode | state B/param meas / formula | peak MiB meas / planner | "
          "DP MiB per step meas / derived | step s |\n|---|---|---|---|---|---|---|")
    pool = Workers(args.dp, timeout=1200)
    try:
        for precision in ("fp32", "bf16"):
            for name, mode in MODES:
                cfg = config(args.dp, precision, mode)
                r = pool.run(ours, cfg, args.steps)[0]
                plan = Plan(cfg)
                est = memory_per_rank(plan, CPU_EAGER)[0]
                derived = {k: v for k, v in call_bytes(plan, 0).items() if k.startswith("dp-")}
                formula = Precision.of(cfg.training).bytes_per_param(args.dp, cfg.training.sharding_strategy)
                meas_b = sum(r["bytes"].values()) / MiB
                print(f"| fivefold | {precision} | {name} | {r['state'] / r['params']:.2f} / {formula:.2f} | "
                      f"{r['peak'] / MiB:.1f} / {est.total / MiB:.1f} | {meas_b:.1f} / {sum(derived.values()) / MiB:.1f} "
                      f"| {r['time']:.3f} |", flush=True)
            f = pool.run(fsdp2, config(args.dp, precision, {}), args.steps)[0]
            print(f"| FSDP2 fully_shard | {precision} | ZeRO-3 | - | {f['peak'] / MiB:.1f} / - | "
                  f"- / {sum(f['bytes'].values()) / MiB:.1f} | {f['time']:.3f} |", flush=True)
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
