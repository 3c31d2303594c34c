"""Per-rank activation memory of one decoder layer under TP and SP, and our TP block against
torch-native DTensor tensor parallelism on the same shapes and ranks.

    python benchmarks/tp_memory.py            # two tables (Markdown), ~1 minute on 2 CPU cores

Table 1, per layer and microbatch, per rank, at TP=1 and at TP=2, 4 with and without SP:
  measured   bytes of the distinct tensors autograd saves for backward during the layer's forward
             (saved_tensors_hooks, deduplicated by storage, parameters excluded)
  derived    the same count from the architecture (`derived_bytes`: which tensor each op keeps)
  Korthikanti et al. 2022 (GPT-3: 16-bit activations, 1-byte dropout masks, 4h MLP, s x s scores
  materialised):  sbh(10 + 24/t + 5as/(ht)) without SP,  sbh(34/t + 5as/(ht)) with SP, for reference.
Table 2: forward+backward of the same layer, ours vs `parallelize_module` with ColwiseParallel /
RowwiseParallel (+ SequenceParallel norms with SP): median step time and peak tensor memory
(torch.distributed._tools.mem_tracker.MemTracker), and the max difference of the two outputs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fivefold.config.schema import ModelConfig  # noqa: E402
from fivefold.model.decoder import Decoder  # noqa: E402
from fivefold.model.rope import rope_tables  # noqa: E402
from fivefold.parallel.tensor.heads import split_heads  # noqa: E402
from fivefold.runtime.mesh import Mesh  # noqa: E402
from fivefold.testing.harness import Workers  # noqa: E402
from fivefold.topology import Layout  # noqa: E402

MiB = 2**20


def model_config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=4 * a.hidden,
                       vocab_size=256)


def derived_bytes(cfg: ModelConfig, b: int, s: int, t: int, sp: bool, elem: int = 4) -> int:
    """What our layer keeps for backward, per rank (fp32 = 4 bytes per element):
      each RMSNorm (2): input x, x/rms, w*x/rms (this last one is also the column layer's saved
        input), all (b, s/t if SP else s, h); 1/rms (b, s_local, 1) kept by two ops
      attention: rope(q) (b, a/t, s, d), rope(k), v (b, g_r, s, d), output (b, a/t, s, d),
        log-sum-exp (b, a/t, s); RoPE cos, sin (s, d). o_proj's input (b, s, a/t * d) is a view of
        the output, not a copy: CPU flash attention returns it laid out as (b, s, a, d)
      SwiGLU: gate, silu(gate), up, silu(gate)*up (down_proj's input): 4 x (b, s, f/t)"""
    h, a, d, f = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_size
    g_r = len(split_heads(a, cfg.kv_heads, t, 0).kv_heads)
    s_local = s // t if sp else s
    norms = 2 * (3 * b * s_local * h + b * s_local)
    attn = 2 * b * (a // t) * s * d + 2 * b * g_r * s * d + b * (a // t) * s + 2 * s * d
    mlp = 4 * b * s * (f // t)
    return elem * (norms + attn + mlp)


def korthikanti_bytes(cfg: ModelConfig, b: int, s: int, t: int, sp: bool) -> float:
    h, a = cfg.hidden_size, cfg.num_attention_heads
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))


def _saved_bytes(fn, params) -> tuple[object, int]:
    """Run fn(); bytes of the distinct non-parameter storages autograd saved meanwhile."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return out, sum(seen.values())


def _dtensor_layer(cfg, tp: int, sp: bool, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    layer = Decoder(cfg, layers=[0], embedding=False, head=False, seed=seed).layers["0"]
    row = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan = {f"attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
    plan |= {"attn.o_proj": row, "mlp.down_proj": row}
    if sp:  # TorchTitan's plan: norms on sequence shards, the blocks' inputs gathered on entry
        plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                 "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
                 "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return parallelize_module(layer, init_device_mesh("cpu", (tp,)), plan)


def _case(rank, world, impl, sp, b, s, hidden, heads, iters):
    from torch.distributed._tools.mem_tracker import MemTracker

    a = argparse.Namespace(hidden=hidden, heads=heads)
    cfg = model_config(a)
    mesh = Mesh.build(Layout(tp=world))
    if impl == "ours":
        layer = Decoder(cfg, mesh=mesh, layers=[0], embedding=False, head=False, seed=0, sequence_parallel=sp).layers["0"]
    else:
        layer = _dtensor_layer(cfg, world, sp, seed=0)
    cos, sin = rope_tables(torch.arange(s), cfg.head_dim, cfg.rotary_base)
    x_full = torch.randn(b, s, hidden, generator=torch.Generator().manual_seed(1))
    x = (x_full.chunk(world, 1)[mesh.tp.rank] if sp else x_full).clone().requires_grad_(True)

    def step():
        y = layer(x, cos, sin)
        y.backward(torch.ones_like(y))
        return y

    for _ in range(2):  # warm-up: allocator, thread pools, DTensor's sharding-propagation caches
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    tracker = MemTracker()
    tracker.track_external(layer, x)
    with tracker:
        y = step()
    peak = max(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    act = None
    if impl == "ours":
        _, act = _saved_bytes(lambda: layer(x, cos, sin), layer.parameters())
    return {"time": statistics.median(times), "peak": peak, "act": act, "y": y.detach()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    cfg = model_config(a)
    b, s = a.batch, a.seq
    shape = (b, s, a.hidden, a.heads, a.iters)
    print(f"one decoder layer: b={b} s={s} h={a.hidden} heads={a.heads} (MHA) head_dim={cfg.head_dim} "
          f"ffn={cfg.ffn_size} (SwiGLU), fp32, gloo on CPU, 1 intra-op thread per rank\n")
    rows, versus = [], []
    for tp in (1, 2, 4):
        pool = Workers(tp)
        try:
            for sp in ((False,) if tp == 1 else (False, True)):
                ours = pool.run(_case, "ours", sp, *shape)
                rows.append((tp, sp, ours[0]["act"], derived_bytes(cfg, b, s, tp, sp), korthikanti_bytes(cfg, b, s, tp, sp)))
                if tp > 1:
                    theirs = pool.run(_case, "dtensor", sp, *shape)
                    diff = max(float((o["y"] - t["y"]).abs().max()) for o, t in zip(ours, theirs))
                    versus.append((tp, sp, max(o["time"] for o in ours), max(t["time"] for t in theirs),
                                   max(o["peak"] for o in ours), max(t["peak"] for t in theirs), diff))
        finally:
            pool.close()
    base = rows[0][2]
    print("| TP | SP | measured (MiB) | derived from the architecture (MiB) | vs TP=1 | Korthikanti formula (MiB, 16-bit GPT-3) | formula vs TP=1 |")
    print("|---|---|---|---|---|---|---|")
    for tp, sp, act, der, kor in rows:
        print(f"| {tp} | {'on' if sp else 'off'} | {act / MiB:.3f} | {der / MiB:.3f} | {act / base:.2f} | "
              f"{kor / MiB:.3f} | {kor / rows[0][4]:.2f} |")
    print("\n| TP | SP | step ours (ms) | step DTensor (ms) | time ours/DTensor | peak ours (MiB) | peak DTensor (MiB) "
          "| peak ours/DTensor | max output diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp, sp, to, tt, po, pt, diff in versus:
        print(f"| {tp} | {'on' if sp else 'off'} | {to * 1e3:.1f} | {tt * 1e3:.1f} | {to / tt:.2f} | {po / MiB:.2f} | "
              f"{pt / MiB:.2f} | {po / pt:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
