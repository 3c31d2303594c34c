"""One MoE layer (router + top-k experts): ours against HF transformers' Mixtral block with the same
weights on one process, and ours under expert parallelism (EP) per rank.

    python benchmarks/moe_layer.py                 # one table (Markdown), ~1 minute on 2 CPU cores
    python benchmarks/moe_layer.py --tokens 8192 --experts 16

Rows: forward + backward of the layer over --tokens tokens (one sequence), fp32, one thread per rank:
  HF Mixtral block   transformers' MixtralSparseMoeBlock (experts fused as gate_up_proj / down_proj)
  ours EP1           fivefold.model.moe.MoE on one process, weights copied from the HF block
  ours EPn           the same layer, experts split over n ranks (each rank routes its 1/n of the
                     tokens, as DP x EP or SP ranks do; all-to-all dispatch and combine)
Columns: median step time (slowest rank) and its ratio to HF; peak bytes of tensors created during the
step (largest rank) and its ratio to HF; parameter bytes per rank; the max difference of the output
from HF's (EP1 only; EP rows compute other tokens per rank).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pp_schedules import timed_peak  # noqa: E402
from fivefold.config.schema import ModelConfig  # noqa: E402
from fivefold.model.init import init_parameters_  # noqa: E402
from fivefold.model.moe import MoE, MoEGroups  # noqa: E402
from fivefold.runtime import comm  # noqa: E402
from fivefold.runtime.mesh import Mesh  # noqa: E402
from fivefold.testing.harness import Workers  # noqa: E402
from fivefold.topology import Layout  # noqa: E402


def _cfg(args) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=4, num_experts=args.experts,
                       moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn)


def _ours(cfg: ModelConfig, groups: MoEGroups = MoEGroups()) -> MoE:
    block = MoE(cfg, groups=groups)
    with torch.no_grad():
        init_parameters_(block, seed=3, std=0.2, vocab_size=cfg.vocab_size)
    return block


def _hf_copy(ours: MoE, args):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    theirs = MixtralSparseMoeBlock(MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                                 num_local_experts=args.experts, num_experts_per_tok=args.topk))
    params = dict(theirs.named_parameters())
    with torch.no_grad():
        params["gate.weight"].copy_(ours.router.weight)
        for e, ex in ours.experts.items():
            params["experts.gate_up_proj"][int(e)].copy_(torch.cat([ex.gate_proj.weight, ex.up_proj.weight]))
            params["experts.down_proj"][int(e)].copy_(ex.down_proj.weight)
    return theirs


def _tokens(args, n: int = 1, r: int = 0) -> torch.Tensor:
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    return x.chunk(n, dim=1)[r].clone().requires_grad_(True)


def _measure(module, x, iters: int, barrier) -> dict:
    def step():
        y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))
        return y.detach()

    t, peak, out = timed_peak(step, iters, barrier)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"time": t, "peak": peak, "params": params, "out": out}


def _ep(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    mesh = Mesh.build(Layout(dp=world, ep=world))
    block = _ours(_cfg(args), MoEGroups.of(mesh))
    return _measure(block, _tokens(args, world, rank), args.iters, lambda: comm.barrier(mesh.ep))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ours = _ours(_cfg(args))
    theirs = _hf_copy(ours, args)
    hf = _measure(theirs, _tokens(args), args.iters, lambda: None)
    mine = _measure(ours, _tokens(args), args.iters, lambda: None)
    print(f"MoE layer fwd+bwd: {args.tokens} tokens, h={args.hidden}, {args.experts} experts of width {args.ffn}, "
          f"top-{args.topk}, fp32, one thread per rank, median of {args.iters}\n")
    print("| implementation | step ms (slowest rank) | time / HF | peak MiB (max rank) | memory / HF | "
          "param MiB per rank | max abs diff |")
    print("|---|---|---|---|---|---|---|")

    def row(name, r, diff=""):
        print(f"| {name} | {r['time'] * 1e3:.1f} | {r['time'] / hf['time']:.2f} | {r['peak'] / 2**20:.1f} | "
              f"{r['peak'] / hf['peak']:.2f} | {r['params'] / 2**20:.2f} | {diff} |", flush=True)

    row("HF MixtralSparseMoeBlock", hf, "0")
    row("ours EP1", mine, f"{float((mine['out'] - hf['out']).abs().max()):.1e}")
    for n in (2, 4):
        pool = Workers(n, timeout=900)
        try:
            outs = pool.run(_ep, args)
        finally:
            pool.close()
        worst = {"time": max(o["time"] for o in outs), "peak": max(o["peak"] for o in outs),
                 "params": max(o["params"] for o in outs)}
        row(f"ours EP{n} (1/{n} of the tokens per rank)", worst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
