"""One MoE layer (router + top-k experts): ours against HF transformers' Mixtral block with the same
weights on one process, ours under expert parallelism (EP) per rank, token dropping, grouped experts,
and load balancing by aux loss against the expert bias.

    python benchmarks/moe_layer.py                 # four tables (Markdown), a few minutes on 2 CPU cores
    python benchmarks/moe_layer.py --tokens 8192 --experts 16 --tables hf,modes

Tables (--tables, default all):
  hf       forward + backward of the layer over --tokens tokens (one sequence), fp32, one thread per rank:
             HF Mixtral block   transformers' MixtralSparseMoeBlock (experts fused as gate_up_proj / down_proj)
             ours EP1           fivefold.model.moe.MoE on one process, weights copied from the HF block
             ours EPn           the same layer, experts split over n ranks (each rank routes its 1/n of the
                                tokens, as DP x EP or SP ranks do; all-to-all dispatch and combine)
           Columns: median step time (slowest rank) and its ratio to HF; peak bytes of tensors created
           during the step (largest rank) and its ratio to HF; parameter bytes per rank; the max
           difference of the output from HF's (EP1 only; EP rows compute other tokens per rank).
  modes    ours EP1, the same tokens: dropless against capacity factor 1.0 (probs policy; padded to
           capacity too), with the fraction of assignments dropped.
  grouped  ours EP1, dropless: the per-expert loop against one torch._grouped_mm per projection
           (model.moe_grouped_gemm) at --experts and 8x as many experts of 1/8 the width (the same FLOPs).
  balance  a skewed toy router (sigmoid, 8 experts, top-2; feature 0 favours the low experts) trained
           50 steps of 4 micro-batches x 256 tokens on a toy regression loss with AdamW (lr 1e-3 and
           1e-2; the toy loss moves the router too): nothing, the aux loss (coeff 1e-2, 1e-1), the
           expert bias (rate 1e-3, DeepSeek-V3's), both; the load imbalance (busiest expert / mean,
           fivefold.train.moe_metrics) over the steps.
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
from fivefold.model.moe import MoE, MoEGroups, reset_step_totals, set_aux_loss_scale, update_expert_biases  # noqa: E402
from fivefold.train.moe_metrics import imbalance  # noqa: E402
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


def _hf_table(args) -> None:
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


def _variant(args, **fields) -> tuple[dict, float]:
    """Ours EP1 with `fields` set on the config: the measurement and the fraction of assignments dropped."""
    cfg = _cfg(args)
    for k, v in fields.items():
        setattr(cfg, k, v)
    block = _ours(cfg)
    r = _measure(block, _tokens(args), args.iters, lambda: None)
    reset_step_totals(block)
    block(_tokens(args))  # one counted forward
    totals = block.step_totals
    dropped = float(totals[1] / totals[2].clamp(min=1))
    return r, dropped


def _modes_table(args) -> None:
    print(f"\nDropless against capacity factor 1.0: ours EP1, {args.tokens} tokens, {args.experts} experts, "
          f"top-{args.topk}, fp32, one thread, median of {args.iters}\n")
    print("| mode | step ms | time / dropless | peak MiB | assignments dropped |")
    print("|---|---|---|---|---|")
    base, _ = _variant(args)
    for name, fields in (("dropless", {}), ("capacity 1.0, probs", dict(moe_expert_capacity_factor=1.0)),
                         ("capacity 1.0, padded to capacity", dict(moe_expert_capacity_factor=1.0,
                                                                   moe_pad_expert_input_to_capacity=True))):
        r, dropped = _variant(args, **fields)
        print(f"| {name} | {r['time'] * 1e3:.1f} | {r['time'] / base['time']:.2f} | {r['peak'] / 2**20:.1f} | "
              f"{dropped:.1%} |", flush=True)


def _grouped_table(args) -> None:
    print(f"\nPer-expert loop against grouped experts (torch._grouped_mm): ours EP1, dropless, {args.tokens} tokens, "
          f"top-{args.topk}, fp32, one thread, median of {args.iters}\n")
    print("| experts x width | loop ms | grouped ms | grouped / loop | max abs diff |")
    print("|---|---|---|---|---|")
    for experts, ffn in ((args.experts, args.ffn), (8 * args.experts, args.ffn // 8)):
        shape = argparse.Namespace(**{**vars(args), "experts": experts, "ffn": ffn})
        loop, _ = _variant(shape, moe_grouped_gemm=False)
        grouped, _ = _variant(shape, moe_grouped_gemm=True)
        diff = float((loop["out"] - grouped["out"]).abs().max())
        print(f"| {experts} x {ffn} | {loop['time'] * 1e3:.1f} | {grouped['time'] * 1e3:.1f} | "
              f"{grouped['time'] / loop['time']:.2f} | {diff:.1e} |", flush=True)


BALANCE_STEPS, MICRO, MICRO_TOKENS, TOY_H, TOY_E = 50, 4, 256, 64, 8


def _balance(aux: float, bias: bool, lr: float = 1e-3) -> list[float]:
    """The imbalance of each of the toy's steps (before that step's update)."""
    cfg = ModelConfig(num_layers=1, hidden_size=TOY_H, num_attention_heads=4, num_experts=TOY_E, moe_router_topk=2,
                      moe_ffn_hidden_size=64, moe_router_score_function="sigmoid", moe_aux_loss_coeff=aux,
                      moe_router_enable_expert_bias=bias)
    block = _ours(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.router.weight.normal_(0, 0.05, generator=g)
        block.router.weight[:, 0] += torch.linspace(0.3, -0.3, TOY_E)  # feature 0 (mean 1) favours the low experts
    x = torch.randn(MICRO, 1, MICRO_TOKENS, TOY_H, generator=g)
    x[..., 0] += 1.0
    target = torch.randn(MICRO, 1, MICRO_TOKENS, TOY_H, generator=g)
    opt = torch.optim.AdamW(block.parameters(), lr=lr, weight_decay=0.0)
    set_aux_loss_scale(block, 1 / MICRO)
    out = []
    for _ in range(BALANCE_STEPS):
        reset_step_totals(block)
        opt.zero_grad()
        for mb, want in zip(x, target):
            ((block(mb) - want).square().mean() / MICRO).backward()
        out.append(float(imbalance(block.step_totals[3:])))
        update_expert_biases(block, None)
        opt.step()
    return out


def _balance_table(args) -> None:
    print(f"\nLoad balancing on a skewed toy router: sigmoid, {TOY_E} experts, top-2, h={TOY_H}, {BALANCE_STEPS} steps "
          f"of {MICRO} x {MICRO_TOKENS} tokens, AdamW on a toy regression loss; imbalance = busiest expert's "
          "assignments / mean, over the step\n")
    picks = (0, 9, 24, BALANCE_STEPS - 1)
    print("| balancing | AdamW lr | " + " | ".join(f"step {s}" for s in picks) + " | best step |")
    print("|---|---|" + "---|" * (len(picks) + 1))
    for lr in (1e-3, 1e-2):
        for name, aux, bias in (("none", 0.0, False), ("aux loss 1e-2", 1e-2, False), ("aux loss 1e-1", 1e-1, False),
                                ("expert bias 1e-3", 0.0, True), ("aux loss 1e-2 + expert bias 1e-3", 1e-2, True)):
            steps = _balance(aux, bias, lr)
            print(f"| {name} | {lr:g} | " + " | ".join(f"{steps[s]:.2f}" for s in picks) + f" | {min(steps):.2f} |",
                  flush=True)


TABLES = {"hf": _hf_table, "modes": _modes_table, "grouped": _grouped_table, "balance": _balance_table}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)}")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.tables.split(","):
        TABLES[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
