"""Text output of `fivefold plan` / `fivefold estimate`: the ranked table, one layout's breakdown,
--explain (why this layout, the seeds' rules side by side), seed 002's memory example."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from fivefold.config.schema import ModelConfig
from fivefold.planner.time.layer_collectives import layer_collectives
from fivefold.planner.search.compare import held_text, held_to, rank_of
from fivefold.planner.layout import Plan
from fivefold.planner.memory.kinds import MemoryAssumptions, RankMemory
from fivefold.planner.memory.peak import memory_per_rank
from fivefold.planner.memory.mtp import mtp_stage_layers
from fivefold.planner.presets.hardware import Hardware
from fivefold.planner.search.ranking import Candidate, evaluate
from fivefold.planner.search.configs import make_config, with_a2a_overlap
from fivefold.planner.search.space import layer_splits
from fivefold.planner.time.time_assumptions import TimeAssumptions
from fivefold.planner.report.seeds import (GB, SEED_ACCOUNTING_EXPLAINED, SeedRule, rules_for, seed_memory_accounting,
                                           sequence_rule)

GiB = 2**30


def table(cands: list[Candidate], top: int) -> str:
    shown = cands[:top]
    w = max([62] + [len(c.label) for c in shown])  # the longest label shown sets the column
    head = (f"{'#':>3} {'layout':<{w}} {'step s':>8} {'MFU':>6} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'bubble':>7} "
            f"{'comm':>6} {'GiB':>6}")
    lines = [head, "-" * len(head)]
    for i, c in enumerate(shown, 1):
        e = c.estimate
        lines.append(f"{i:>3} {c.label:<{w}} {e.step_time:>8.2f} {e.mfu:>6.1%} {e.tokens_per_s_per_gpu:>10.0f} "
                     f"{e.tflops_per_gpu:>8.0f} {e.bubble_fraction:>7.1%} {e.comm_fraction:>6.1%} "
                     f"{c.memory.total / GiB:>6.1f}")
    return "\n".join(lines)


FORWARD_ONLY_KINDS = ("weights", "activations", "logits", "overhead", "reserve")
"""The memory rows of a forward-only model (planner/search/forward.py): it has no gradients, optimizer state,
optimizer scratch or pipeline buffers held beside its forward."""


def breakdown(c: Candidate, hw: Hardware, forward_only: bool = False) -> str:
    """Memory by kind (worst pipeline rank) and time by kind of one layout; `forward_only`: `c` from
    `forward.evaluate_forward`, its time a forward over the global batch."""
    m, lines = c.memory, [f"layout: {c.label}"]
    if not c.sized:  # a broken rule: nothing was sized
        return "\n".join(lines + [f"dropped: {c.problem}"])
    p = c.plan
    b = c.config.training.global_batch_size
    per = "forward" if forward_only else "step"
    lines.append(f"batch: {b} sequence{'s' * (b != 1)} of {p.seq} tokens per {per}, "
                 f"{p.microbatches} microbatch{'es' * (p.microbatches != 1)} of {p.mbs} per DP rank")
    if forward_only:
        lines.append(f"memory per GPU (pipeline rank {m.rank}, forward-only: no gradients or optimizer state), GiB:")
    else:
        lines.append(f"memory per GPU (pipeline rank {m.rank}, {m.inflight:g} microbatches in flight), GiB:")
    for k, v in m.as_dict().items():
        if not forward_only or k in FORWARD_ONLY_KINDS:
            lines.append(f"  {k:<12} {v / GiB:8.2f}")
    lines.append(f"  {'total':<12} {m.total / GiB:8.2f} of {hw.memory_bytes / GiB:.0f} "
                 f"(headroom {(hw.memory_bytes - m.total) / GiB:.1f})")
    e = c.estimate
    if e is None:
        lines.append(f"dropped: {c.problem}")
        return "\n".join(lines)
    parts = ", ".join(f"{k} {v:.3f}" for k, v in e.parts.items())
    if forward_only:
        lines.append(f"forward time {e.step_time:.3f} s per global batch of {b} sequence{'s' * (b != 1)}: {parts}")
        lines.append(f"MFU {e.mfu:.1%} (forward FLOPs), {e.tflops_per_gpu:.0f} model TFLOP/s per GPU, "
                     f"{e.tokens_per_s_per_gpu:.0f} tokens/s per GPU; bubble {e.bubble_fraction:.1%} (forward-only "
                     f"pipeline), exposed communication {e.comm_fraction:.1%}")
    else:
        lines.append(f"step time {e.step_time:.3f} s: {parts}")
        lines.append(f"MFU {e.mfu:.1%}, {e.tflops_per_gpu:.0f} model TFLOP/s per GPU, {e.tokens_per_s_per_gpu:.0f} "
                     f"tokens/s per GPU; bubble {e.bubble_fraction:.1%}, exposed communication {e.comm_fraction:.1%}")
    lines.append("links: " + ", ".join(f"{g}={v}" for g, v in e.links.items()))
    lines.append(f"bytes sent per rank per {per} (GB): "
                 + ", ".join(f"{k} {v / GB:.2f}" for k, v in e.comm_bytes.items()))
    return "\n".join(lines)


def why(c: Candidate, model: ModelConfig, gpus_per_node: int, ranked: list[Candidate] = (), hw: Hardware | None = None,
        assume: "Assumed | None" = None) -> list[str]:
    """Reasons for `c`'s choices; with the ranked list, whether its CP pays for itself (`cp_verdict`), and
    with the hardware and the search's assumptions, what its EP trades (`ep_verdict`)."""
    p, e = c.plan, c.estimate
    out = []
    if p.tp > 1:
        calls = sum(c.group == "tp" for c in layer_collectives(p, model.num_layers - 1))
        out.append(f"TP={p.tp}: its {calls} collectives per layer stay on the {e.links['tp']} link "
                   f"({gpus_per_node} GPUs per node); heads {model.num_attention_heads}/{p.tp} = "
                   f"{model.num_attention_heads // p.tp} per rank")
    else:
        out.append("TP=1: no per-layer collectives; the model state fits without splitting matrices")
    if p.pp > 1:
        out.append(f"PP={p.pp} over the {e.links['pp']} link: only {e.comm_bytes['pp'] / GB:.2f} GB per rank per step "
                   f"cross it; bubble {e.bubble_fraction:.1%} with {p.microbatches} microbatches"
                   + (f" and {p.vpp} chunks per rank" if p.vpp > 1 else ""))
    if p.cp > 1:
        out.append(f"CP={p.cp} ({c.config.parallel.cp_comm_type}): sequence {p.seq} -> {p.seq // p.cp} tokens per rank"
                   + (f"; {cp_verdict(c, ranked)}" if ranked else ""))
    if model.is_moe:
        sent = f"all-to-all on the {e.links['ep']} link" if p.ep > 1 else "no all-to-all"
        out.append(f"EP={p.ep} (ETP={p.etp}, expert-DP={p.edp}): {model.num_experts // p.ep} experts per rank; {sent}"
                   + (f"; {ep_verdict(c, ranked, hw, assume)}" if assume else ""))
    line = f"DP={p.dp}: gradient traffic on the {e.links['dp']} link, exposed {e.parts['dp']:.3f} s"
    mode = c.config.training.sharding_strategy
    if mode in ("optim_grads", "optim_grads_params"):
        fsdp = "Megatron-FSDP: " if c.config.training.use_megatron_fsdp else ""
        line += (f"; {fsdp}{'ZeRO-2' if mode == 'optim_grads' else 'ZeRO-3'} reduce-scatters "
                 + (f"after each of the {p.microbatches} microbatches into 1/{p.dp * p.cp} gradient shards"
                    + (f" (DP x CP = {p.dp} x {p.cp})" if p.cp > 1 else "")
                    if p.reduce_every_microbatch else "the step's whole gradient buffers once"))
    out.append(line)
    return out


def versus(c: Candidate, other: Candidate) -> str:
    """`other`'s step time against `c`'s, and the time parts that differ most (other minus c)."""
    e, o = c.estimate, other.estimate
    diffs = sorted(((o.parts[k] - e.parts.get(k, 0.0), k) for k in o.parts), key=lambda d: -abs(d[0]))[:3]
    spent = ", ".join(f"{k} {d:+.2f} s" for d, k in diffs if abs(d) >= 5e-4) or "the same time parts"
    return f"{other.label}, takes {o.step_time:.2f} s/step ({o.step_time / e.step_time:.2f}x; {spent})"


def cp_verdict(c: Candidate, ranked: list[Candidate]) -> str:
    """Whether a CP layout pays for itself: against the fastest fitting layout without CP, the step
    time, the time parts that differ most, and the memory CP frees."""
    plain = next((r for r in ranked if r.plan.cp == 1), None)
    if plain is None:
        return "pays for itself: no layout without CP fits in memory"
    verdict = "pays for itself" if plain.estimate.step_time > c.estimate.step_time else "does not pay for itself"
    freed = (plain.memory.activations - c.memory.activations) / GiB
    held = (f"frees {freed:.1f} GiB of activations per GPU" if freed >= 0.05 else
            f"holds {-freed:.1f} GiB more activations per GPU" if freed <= -0.05 else
            "holds the same activations per GPU as it")
    return f"{verdict}: the fastest layout without CP, {versus(c, plain)}; CP {held}"


def ep_verdict(c: Candidate, ranked: list[Candidate], hw: Hardware, assume: "Assumed") -> str:
    """What a MoE layout's EP trades: the same layout with EP halved (twice the experts a rank: their
    weights, gradients and optimizer state replicated over twice the expert-DP ranks, less all-to-all
    off the node) and doubled, each sized and timed as the search does (`assume`): its model state
    against this one's, and its step time, rank and the time parts that differ most, or why it is out."""
    p, out = c.plan, []
    experts = c.config.model.num_experts
    for ep in [e for e in ((p.ep // 2,) if p.ep % 2 == 0 else ()) + (p.ep * 2,) if experts % e == 0]:
        # halved where EP is even, doubled where the experts still split over it
        par = replace(c.config.parallel, expert_model_parallel_size=ep, overlap_moe_expert_parallel_comm=False)
        cfg = replace(c.config, parallel=par)
        other = evaluate(with_a2a_overlap(cfg) if c.config.parallel.overlap_moe_expert_parallel_comm else cfg,
                         hw, assume.mem, assume.ta)
        head = f"EP{ep} ({experts // ep} experts a rank, the rest the same)"
        if not other.sized:
            out.append(f"{head} breaks a rule: {other.problem}")
            continue
        state = sum(getattr(other.memory, k) - getattr(c.memory, k) for k in ("weights", "grads", "optimizer")) / GiB
        held = f"{state:+.1f} GiB of model state"
        if other.estimate is None:
            out.append(f"{head}: {held}, does not fit ({other.problem})")
        else:
            out.append(f"{head}: {held}, ranks {rank_of(other, ranked)}: {versus(c, other)}")
    return "; ".join(out)


def compare_report(text: str, cand: Candidate, best: Candidate, ranked: list[Candidate], model: ModelConfig,
                   hw: Hardware, gpus_per_node: int, assume: "Assumed | None" = None) -> str:
    """A layout the user named (`plan --compare`): where it ranks, where its time and memory go, and
    what the top choice does differently."""
    rank = rank_of(cand, ranked)
    if rank is None:
        head = f"Compared \"{text}\": {'does not fit' if cand.sized else 'breaks a rule'}, so it has no rank"
    else:
        e, b = cand.estimate, best.estimate
        searched = any(c.label == cand.label for c in ranked)
        head = (f"Compared \"{text}\": rank {rank} of {len(ranked)}" + ("" if searched else
                " (not a variant the search ranks: where it would stand)")
                + f", {e.step_time / b.step_time:.2f}x the top choice's step time")
        diffs = sorted(((e.parts[k] - b.parts.get(k, 0.0), k) for k in e.parts), reverse=True)
        head += "\n  vs the top choice, seconds per step: " + ", ".join(f"{k} {d:+.3f}" for d, k in diffs)
        held = held_to(cand, ranked) if rank > 5 else None
        if held:  # the choices the search weighs against it (a constraint of the run, or what costs it)
            head += f"\n  {held_text(cand, held)}"
    lines = [head, breakdown(cand, hw)]
    if cand.estimate is not None:
        lines += ["Why:"] + [f"  - {w}" for w in why(cand, model, gpus_per_node, ranked, hw, assume)]
    return "\n".join(lines)


def seed_candidate(rule: SeedRule, model: ModelConfig, hw: Hardware, world: int, gpus_per_node: int, seq: int,
                   global_batch: int, precision: str, assume: Assumed) -> tuple[Candidate | None, str]:
    """The fastest fitting reading of a seed rule (ranges tried; where the layers do not divide over
    PP, the uneven splits the search itself tries; recompute added if needed), or why none; sized and
    timed as the search's layouts are (`assume`: the runtime's)."""
    best, reasons = None, []
    for tp in rule.tp:
        for pp in rule.pp:
            for split in layer_splits(model.num_layers, pp, 1, last_extra=mtp_stage_layers(model)) or [{}]:
                parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, pipeline_model_parallel_size=pp,
                                context_parallel_size=rule.cp, expert_model_parallel_size=rule.ep, **split)
                for recompute in (None, "selective", "full"):
                    cfg = make_config(model, world, gpus_per_node, seq, global_batch, precision, parallel,
                                      recompute=recompute, grad_reduce_in_bf16=assume.grad_reduce_in_bf16,
                                      dp_mode=assume.dp_mode, tp_comm_overlap=assume.tp_comm_overlap)
                    c = evaluate(cfg, hw, assume.mem, assume.ta)
                    if c.estimate is None:
                        reasons.append(f"TP{tp} PP{pp} rc={recompute}: {c.problem}")
                        if not c.problem.startswith("needs"):
                            break
                        continue
                    if best is None or c.estimate.step_time < best.estimate.step_time:
                        best = c
                    break
    return best, "; ".join(reasons[-1:])


class Assumed(NamedTuple):
    """What the search assumed of the runtime, for the layouts a report sizes itself (seed rules)."""
    mem: MemoryAssumptions
    ta: TimeAssumptions
    grad_reduce_in_bf16: bool = False
    dp_mode: str | None = None
    tp_comm_overlap: bool = False
    """The search's layouts overlap TP communication (`SearchSpace.tp_comm_overlap`)."""


def sequence_verdict(plan, cp: int, sp: bool) -> str:
    """How a layout stands to seed 002's sequence-length row (CP `cp`, SP `sp`): consistent, further
    (more CP than the row adds: `why` says whether it pays for itself) or differs, and in what."""
    missing_sp = sp and plan.tp > 1 and not plan.sp
    said = [("SP moot at TP1" if plan.tp == 1 else "no SP" if missing_sp else "with SP")] if sp else []
    said.append(f"CP{plan.cp}" + ("" if plan.cp == cp else f" where the row has CP{cp}"))
    verdict = ("differs" if plan.cp < cp or missing_sp else "further than the row" if plan.cp > cp
               else "consistent")
    return f"{verdict} (top choice: {', '.join(said)})"


def explain(best: Candidate, model: ModelConfig, preset: str | None, total_params: float, hw: Hardware,
            world: int, gpus_per_node: int, seq: int, global_batch: int, precision: str,
            ranked: list[Candidate], assume: Assumed) -> str:
    """The top choice's breakdown and why, then the seeds' rules of thumb beside it, each sized and timed
    with `assume` (the search's: a default here would time them for another runtime than the ranking)."""
    lines = ["Top choice", breakdown(best, hw), "", "Why:"]
    lines += [f"  - {w}" for w in why(best, model, gpus_per_node, ranked, hw, assume)]
    text, cp, sp = sequence_rule(seq)
    lines += ["", f"Seeds' rules of thumb beside the top choice ({best.estimate.step_time:.2f} s/step, "
                  f"MFU {best.estimate.mfu:.1%}):"]
    lines.append(f"  sequence-length table (002): {text} -> {sequence_verdict(best.plan, cp, sp)}")
    for rule in rules_for(preset, total_params, world, gpus_per_node):
        c, why_not = seed_candidate(rule, model, hw, world, gpus_per_node, seq, global_batch, precision, assume)
        if c is None:
            lines.append(f"  {rule.source}: {rule.text}\n      -> not usable here: {why_not}")
        else:
            e = c.estimate
            lines.append(f"  {rule.source}: {rule.text}\n      -> {c.label}: {e.step_time:.2f} s/step "
                         f"({e.step_time / best.estimate.step_time:.2f}x the top choice), MFU {e.mfu:.1%}, "
                         f"{c.memory.total / GiB:.1f} GiB")
    return "\n".join(lines)


def seed_memory_example(model: ModelConfig, total_params: float, hw: Hardware, global_batch: int = 64) -> str:
    """Seed 002's 'LLaMA 3 70B with TP=4, PP=4, DP=4 on 64 GPUs' in its accounting and ours (GB = 1e9)."""
    seed = seed_memory_accounting(70e9, 4, 4)
    rows = []
    for distopt in (False, True):
        cfg = make_config(model, 64, 8, 4096, global_batch, "bf16",
                          dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=4, sequence_parallel=True),
                          distributed_optimizer=distopt)
        rows.append(max(memory_per_rank(Plan(cfg)), key=lambda r: r.total))
    a: RankMemory = rows[0]
    lines = ["Seed 002 memory example: Llama 3 70B, TP=4 PP=4 DP=4, 64 GPUs, seq 4096, micro-batch 1 (GB = 1e9 bytes)",
             f"{'':<14}{'seed 002':>10}{'standard':>10}{'+distopt':>10}"]
    for k, seed_v in (("weights", seed.weights), ("grads", seed.grads), ("optimizer", seed.optimizer),
                      ("activations", seed.activations)):
        lines.append(f"{k:<14}{seed_v / GB:>10.2f}{getattr(a, k) / GB:>10.2f}{getattr(rows[1], k) / GB:>10.2f}")
    rest = lambda r: r.logits + r.buffers + r.overhead + r.reserve  # noqa: E731
    lines.append(f"{'other':<14}{0:>10.2f}{rest(a) / GB:>10.2f}{rest(rows[1]) / GB:>10.2f}")
    lines.append(f"{'total':<14}{seed.total / GB:>10.2f}{a.total / GB:>10.2f}{rows[1].total / GB:>10.2f}")
    lines.append(f"(standard = Megatron mixed precision without the distributed optimizer, pipeline rank {a.rank} "
                 f"holding {a.inflight:g} microbatches under 1F1B; {total_params / 1e9:.1f}B parameters)")
    lines.append(SEED_ACCOUNTING_EXPLAINED)
    return "\n".join(lines)
