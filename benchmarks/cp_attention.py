"""Context-parallel causal attention: per-rank time and memory of our ring / all-to-all attention
against the one-process attention of the whole sequence, and against torch's own context parallelism.

    python benchmarks/cp_attention.py                 # one table (Markdown), ~1-2 minutes on 2 CPU cores
    python benchmarks/cp_attention.py --seq 8192 --heads 16

Every row runs forward + backward of causal attention over one sequence of --seq tokens
(q, k, v: (1, heads, s, d); GQA with --kv-heads):
  one process      F.scaled_dot_product_attention on the whole sequence (torch's CPU flash kernel)
  ours CPn <type>  fivefold.parallel.context.context_parallel.ContextParallel: each of n ranks holds 2 of the 2n
                   load-balanced chunks; p2p = ring (K/V rotate, log-sum-exp merge), a2a = all-to-all
                   over heads then whole-sequence SDPA, a2a+p2p = both, allgather = K/V gathered from
                   every rank (Llama 3's; gathered again in backward, dK/dV reduce-scattered)
  torch CPn        torch.distributed.tensor.experimental.context_parallel (ring, round-robin load
                   balance) on the same ranks, when this build supports it on this device
Columns: median step time of the slowest rank and its ratio to one process; peak bytes of tensors
created during the step (the largest rank) and its ratio; the per-rank formula of
docs/context_parallel.md ("Memory per rank") and measured / formula; the output's max difference
from one process (gathered back to sequence order). On CPU every rank shares the same cores, so time ratios
say how much work CP adds per rank, not the speed-up a GPU per rank would give; memory per rank is
the point of CP.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pp_schedules import timed_peak  # noqa: E402
from fivefold.parallel.context.context_parallel import ContextParallel, split_sequence  # noqa: E402
from fivefold.planner.memory.cp_memory import attention_peak_bytes  # noqa: E402
from fivefold.runtime import comm  # noqa: E402
from fivefold.runtime.mesh import Mesh  # noqa: E402
from fivefold.testing.harness import Workers  # noqa: E402
from fivefold.topology import Layout  # noqa: E402

LAYOUTS = [  # (CP size, comm type, a2a size)
    (2, "p2p", 1), (4, "p2p", 1), (2, "a2a", 2), (4, "a2a", 4), (4, "a2a+p2p", 2), (2, "allgather", 1),
    (4, "allgather", 1),
]


def _inputs(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.seq, args.dim, generator=g)
    k = torch.randn(1, args.kv_heads, args.seq, args.dim, generator=g)
    v = torch.randn(1, args.kv_heads, args.seq, args.dim, generator=g)
    do = torch.randn(1, args.heads, args.seq, args.dim, generator=g)
    return q, k, v, do


def _one_process(args) -> dict:
    q, k, v, do = _inputs(args)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=args.heads != args.kv_heads)
        o.backward(do)
        return o.detach()

    t, peak, out = timed_peak(step, args.iters, lambda: None)
    return {"time": t, "peak": peak, "out": out}


def _ours(rank: int, world: int, args, a2a: int, gather: bool) -> dict:
    torch.set_num_threads(1)
    mesh = Mesh.build(Layout(cp=world, cp_a2a=a2a, cp_gather=gather))
    cp = ContextParallel(mesh.group("cp-a2a"), mesh.group("cp-ring"), gathers=gather)
    q, k, v, do = (split_sequence(t, 2, cp.size, cp.rank).clone() for t in _inputs(args))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        o = cp.attention(q, k, v)
        o.backward(do)
        return o.detach()

    t, peak, out = timed_peak(step, args.iters, lambda: comm.barrier(mesh.cp))
    return {"time": t, "peak": peak, "out": out, "rank": cp.rank}


def _torch(rank: int, world: int, args) -> dict:
    """torch's experimental CP: the buffers are sharded in place on entry; SDPA calls inside are
    dispatched to its ring implementation."""
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (world,))
    q, k, v, do = _inputs(args)
    try:
        def step():
            qs, ks, vs, dos = (t.clone() for t in (q, k, v, do))
            with context_parallel(mesh, buffers=[qs, ks, vs, dos], buffer_seq_dims=[2, 2, 2, 2]):
                qg, kg, vg = (t.detach().requires_grad_() for t in (qs, ks, vs))  # buffers stay grad-free
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                o.backward(dos)
            return o.detach()

        t, peak, _ = timed_peak(step, args.iters, lambda: torch.distributed.barrier())
        return {"time": t, "peak": peak}
    except Exception as e:  # noqa: BLE001 — reported in the table, not raised
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"}


def formula_bytes(args, n: int, a2a: int) -> float:
    """docs/context_parallel.md, "Memory per rank" (fivefold.planner.memory.cp_memory), fp32."""
    return attention_peak_bytes(b=1, s=args.seq, heads=args.heads, kv_heads=args.kv_heads, d=args.dim, dv=args.dim,
                                a2a=a2a, ring=n // a2a)


def _gather_order(outs: list[dict], n: int, seq: int) -> torch.Tensor:
    """Each rank's (1, a, s/n, d) output (its chunks r and 2n-1-r) back into sequence order."""
    c = seq // (2 * n)
    full = torch.empty(outs[0]["out"].shape[:2] + (seq, outs[0]["out"].shape[-1]))
    for o in outs:
        r, x = o["rank"], o["out"]
        full[:, :, r * c:(r + 1) * c] = x[:, :, :c]
        full[:, :, (2 * n - 1 - r) * c:(2 * n - r) * c] = x[:, :, c:]
    return full


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ref = _one_process(args)
    print(f"causal attention fwd+bwd, 1 x {args.heads} heads ({args.kv_heads} KV) x {args.seq} tokens x d={args.dim}, "
          f"fp32, gloo on CPU, one thread per rank, median of {args.iters}\n")
    print("| layout | step ms (slowest rank) | time / one process | peak MiB per rank (max) | memory / one process "
          "| formula MiB | measured / formula | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    one = formula_bytes(args, 1, 1)
    print(f"| one process (SDPA) | {ref['time'] * 1e3:.1f} | 1.00 | {ref['peak'] / 2**20:.1f} | 1.00 | "
          f"{one / 2**20:.1f} | {ref['peak'] / one:.3f} | 0 |")
    pools: dict[int, Workers] = {}
    try:
        for n, kind, a2a in LAYOUTS:
            pool = pools.setdefault(n, Workers(n, timeout=900))
            outs = pool.run(_ours, args, a2a, kind == "allgather")
            t, peak = max(o["time"] for o in outs), max(o["peak"] for o in outs)
            diff = float((_gather_order(outs, n, args.seq) - ref["out"]).abs().max())
            want = None if kind == "allgather" else formula_bytes(args, n, a2a)  # the formula is the ring's / a2a's
            formula = f"{want / 2**20:.1f} | {peak / want:.3f}" if want else "- | -"
            print(f"| ours CP{n} {kind} | {t * 1e3:.1f} | {t / ref['time']:.2f} | {peak / 2**20:.1f} | "
                  f"{peak / ref['peak']:.2f} | {formula} | {diff:.1e} |", flush=True)
        for n in sorted(pools):
            outs = pools[n].run(_torch, args)
            if "error" in outs[0]:
                print(f"| torch CP{n} (experimental context_parallel) | n/a: {outs[0]['error']} | | | | | | |")
                continue
            t, peak = max(o["time"] for o in outs), max(o["peak"] for o in outs)
            print(f"| torch CP{n} (experimental context_parallel) | {t * 1e3:.1f} | {t / ref['time']:.2f} | "
                  f"{peak / 2**20:.1f} | {peak / ref['peak']:.2f} | | | |", flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
