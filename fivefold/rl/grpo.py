"""GRPO on the toy addition task (fivefold.rl.tasks), every rank of one job: `fivefold rl examples/grpo.yaml`.

Roles and layouts on the same ranks (colocated, as verl's and SkyRL's default):
  actor      the trained policy, the `actor:` config's layout (e.g. TP2 x DP4 on 8 ranks; TP, SP, CP,
             PP, any DP mode; a dense model), driven through fivefold.engine.Engine;
  rollout    a whole copy of the policy on every rank (TP1 x DP = world), generating with a KV cache
             (fivefold.model.generate); after each actor step the actor's weights reach it through
             fivefold.engine.sync (each rank receives the slices its actor rank does not hold: the
             other TP and pipeline ranks' — the bytes are counted);
  reference  the warmed-up policy, frozen, in the actor's layout (`Engine(frozen=True)`: its weights
             alone, split as the actor's over TP / PP / EP, whole over DP), synced once after the
             warm-up: KL(actor || reference).
A step: every rank takes its share of the prompts, samples `group_size` answers each and scores them
exactly, with group-normalised advantages; the ranks of one actor DP replica (its TP, CP and pipeline
ranks) then pool their rollouts, so each replica trains on the same sequences on every rank of it, the
reference computes their log-probs in the same layout, and the actor takes one PPO step on GRPO's loss
(clipped surrogate around the rollout's log-probs, k3 KL, token-mean). Before RL, a short supervised
warm-up teaches the answer format (a random model earns reward ~0, and all-zero rewards give all-zero
advantages).

Logged per step (metrics.jsonl, and rl.png, which `fivefold plot RUN` draws again): mean reward,
exact-answer rate, KL to the reference, entropy, response length, the train/rollout log-prob mismatch
(|actor - rollout| on the sampled tokens: the two layouts compute the same model in different orders),
bytes synced, seconds.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from fivefold.config.schema import Config, ModelConfig
from fivefold.engine import Batch, Engine
from fivefold.engine import losses as L
from fivefold.errors import UserError, writing_file
from fivefold.model.decoder import Decoder
from fivefold.model.generate import generate
from fivefold.planner.memory.traits import EAGER_TRAITS
from fivefold.planner.memory.activations import Sharding, layer_activation_bytes
from fivefold.planner.layout import Plan
from fivefold.engine.sync import sync_weights
from fivefold.rl.tasks import END, Addition
from fivefold.runtime import comm
from fivefold.train.context import RankContext
from fivefold.train.manual_gc import after_step, manual_gc


@dataclass
class GRPOConfig:
    steps: int = 20
    """GRPO steps."""
    prompts_per_step: int = 16
    """Prompts per step over all ranks (a multiple of the world size)."""
    group_size: int = 8
    """Answers sampled per prompt."""
    lr: float = 1e-3
    kl_coef: float = 0.02
    clip: float = 0.2
    temperature: float = 1.0
    digits: int = 1
    """Operand digits of the addition task."""
    warmup_steps: int = 60
    warmup_batch: int = 32
    """Solved examples per warm-up step over all ranks."""
    warmup_lr: float = 3e-3
    seed: int = 0

    @classmethod
    def of(cls, raw: dict) -> GRPOConfig:
        """The section read from a config: unknown keys, and values not a number of the field's kind,
        refused naming them."""
        known = {f.name: f.type for f in fields(cls)}
        bad = sorted(set(raw) - set(known))
        if bad:
            raise UserError(f"grpo: unknown key{'s' if len(bad) > 1 else ''} {', '.join(bad)}; "
                            f"known: {', '.join(sorted(known))}")
        for name, value in raw.items():
            whole = isinstance(value, int) and not isinstance(value, bool)
            if not (whole or (known[name] == "float" and isinstance(value, float))):
                kind = "a whole number" if known[name] == "int" else "a number"
                raise UserError(f"grpo.{name}={value!r}: must be {kind}")
        return cls(**raw)

    def check(self, world: int, dp: int, seq_length: int) -> None:
        """Every value in its range for a run on `world` ranks of which `dp` actor replicas, with
        `seq_length` tokens a sequence; UserError listing each problem (before any rank starts)."""
        task = Addition(max(1, self.digits))
        problems = [f"grpo.{name}={value}: {rule}" for name, value, ok, rule in (
            ("steps", self.steps, self.steps >= 1, "must be >= 1"),
            ("prompts_per_step", self.prompts_per_step, self.prompts_per_step >= 1 and not self.prompts_per_step % world,
             f"must be a multiple of the {world} ranks"),
            ("group_size", self.group_size, self.group_size >= 2, "must be >= 2 (an answer's advantage is its reward "
             "against the other answers to its prompt: one answer alone has none)"),
            ("lr", self.lr, self.lr >= 0, "must be >= 0"),
            ("kl_coef", self.kl_coef, self.kl_coef >= 0, "must be >= 0"),
            ("clip", self.clip, self.clip > 0, "must be > 0"),
            ("temperature", self.temperature, self.temperature > 0, "must be > 0"),
            ("digits", self.digits, self.digits >= 1, "must be >= 1"),
            ("warmup_steps", self.warmup_steps, self.warmup_steps >= 0, "must be >= 0"),
            ("warmup_batch", self.warmup_batch, self.warmup_batch >= 1 and self.warmup_batch % dp == 0,
             f"must be a multiple of the {dp} actor data-parallel replicas"),
            ("warmup_lr", self.warmup_lr, self.warmup_lr >= 0, "must be >= 0"),
            ("seed", self.seed, self.seed >= 0, "must be >= 0")) if not ok]
        if seq_length < task.prompt_length + task.answer_length:
            problems.append(f"training.seq_length={seq_length}: the task of {task.digits}-digit sums needs "
                            f"{task.prompt_length + task.answer_length} tokens")
        if problems:
            raise UserError("invalid grpo run:\n" + "\n".join(f"  - {p}" for p in problems))

    def answer_bytes(self, model: ModelConfig) -> int:
        """Host memory one sampled answer holds through `run`'s step (from the reference's scoring to
        the actor's update): its sequence (prompt and answer, T tokens) as int64 ids, fp32 loss mask,
        rollout and reference log-probs; the prompt and the sampled tokens (int64) with their fp32
        log-probs, and the rollout's fp32 KV cache of T - 1 positions, as `generate` returns them. (The
        reference's log-softmax over the vocabulary is a transient of its forward, as the actor's.)"""
        task = Addition(self.digits)
        p, a = task.prompt_length, task.answer_length
        t = p + a
        kv_cache = 2 * model.num_layers * model.kv_heads * model.head_dim * 4 * (t - 1)
        return t * (8 + 3 * 4) + 8 * p + (8 + 4) * a + kv_cache

    def step_bytes(self, config: Config, world: int) -> int:
        """Host memory one GRPO step holds at its peak over the `world` ranks of this machine, at least:
        each rank's rollouts (prompts_per_step / world x group_size answers of `answer_bytes`) and the
        actor's step on its DP replica's rollouts (pooled): what each decoder layer saves for the backward,
        as the planner counts it for our eager fp32 runtime (fivefold.planner.memory.activations), and what the
        loss keeps per logit. Leaves out the models and the optimizer (their size does not grow with the
        batch), each rank's interpreter and the transients: measured for examples/grpo.yaml's model
        (one rank at 16 000 and 32 000 answers, 8 ranks as TP2 x DP4 at 16 000; 2026-11-29, the summed
        resident memory of the ranks less a 1-prompt run's), the step's peak grew by 1.24-1.54x this."""
        plan, m = Plan(config), config.model
        task = Addition(self.digits)
        t = task.prompt_length + task.answer_length
        rows = self.prompts_per_step // world * self.group_size  # answers a rank samples
        rollouts = world * rows * self.answer_bytes(m)
        b = rows * plan.tp * plan.cp * plan.pp  # sequences an actor rank trains on: its replica's
        traits = EAGER_TRAITS.for_precision("fp32")
        sh = Sharding.of(tp=plan.tp, sp=plan.sp, cp=plan.cp, etp=plan.etp, recompute=plan.recompute,
                         modules=plan.recompute_modules)
        layers = sum(sum(layer_activation_bytes(m, i, b, t, sh, traits).values()) for i in range(m.num_layers))
        loss = b * t / plan.cp * m.padded_vocab_size(plan.tp) / plan.tp * traits.loss_bytes()
        return int(rollouts + world // plan.pp * (layers + loss))  # each layer, and the loss, on one stage

    def check_memory(self, config: Config, world: int, available: int) -> None:
        """UserError when one step (`step_bytes`) needs more than the `available` bytes of host memory:
        refused before the ranks start, not killed for memory in the middle of a step. The value it
        names keeps the estimate within `MEMORY_SHARE` of it."""
        answers = self.prompts_per_step * self.group_size
        need = self.step_bytes(config, world)
        if need <= available:
            return
        per_answer = need / answers  # (the estimate grows with the answers: each term is per answer)
        fits = int(available * MEMORY_SHARE / per_answer)  # answers
        if fits // self.group_size >= world:
            fix = f"try grpo.prompts_per_step={fits // self.group_size // world * world}"
        elif fits // self.prompts_per_step >= 2:
            fix = f"try grpo.group_size={fits // self.prompts_per_step}"
        else:
            fix = "give a smaller model or more memory"
        raise UserError(f"grpo.prompts_per_step={self.prompts_per_step} x grpo.group_size={self.group_size}: the "
                        f"{answers} answers of a step need at least {_gib(need)} of host memory (the rollouts' "
                        f"tokens, log-probs over the vocabulary and KV cache, the actor's activations on them), more "
                        f"than the {_gib(available)} available on this machine; {fix}")


MEMORY_SHARE = 0.5
"""The share of the available memory the step's estimate (`step_bytes`) may take in the value
`check_memory` suggests: the rest for what it leaves out (the models, the optimizer, each rank's
interpreter and torch, about 350 MB apiece on CPU; the transients, up to 0.55x the estimate more)."""


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _ids(texts: list[str]) -> torch.Tensor:
    return torch.tensor([list(t.encode()) for t in texts], dtype=torch.int64)


def _text(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class _Rollout:
    """A whole copy of the policy on this rank (TP1 x DP = world), refreshed from the actor's shards
    (fivefold.engine.sync: each rank receives only the slices its actor rank does not hold)."""

    def __init__(self, cfg, seed: int):
        self.model = Decoder(cfg, seed=seed).eval()

    def load(self, engine: Engine) -> int:
        """Bytes sent over all ranks."""
        with engine.whole_weights():
            sent = torch.tensor([float(sync_weights(engine.model, self.model))], dtype=torch.float64)
        comm.all_reduce_(sent, engine.parts.mesh.world, tag="rl-metrics")
        return int(sent)


def _warmup(engine: Engine, task: Addition, g: GRPOConfig, ctx: RankContext, rng: np.random.Generator) -> list[float]:
    """Supervised steps on solved examples: next-token loss on the answer, token-mean."""
    per_rank = g.warmup_batch // ctx.dp_size
    losses = []
    for _ in range(g.warmup_steps):
        pairs = task.sample(rng, g.warmup_batch)[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
        texts = [task.prompt(a, b) + task.answer(a, b).ljust(task.answer_length, END) for a, b in pairs]
        ids = _ids(texts)
        mask = torch.zeros_like(ids, dtype=torch.float32)
        mask[:, task.prompt_length:] = 1
        nll = lambda stats, mb, totals: L.aggregate(-stats.logprobs, mb.loss_mask, "token-mean", totals["tokens"])  # noqa: E731
        losses.append(engine.train_batch(Batch(ids, mask), nll, lr=g.warmup_lr,
                                         micro_batch_size=engine.config.training.micro_batch_size)["loss"])
    return losses


def _response_mask(completions: torch.Tensor) -> torch.Tensor:
    """1 on the answer's tokens up to and including its first end mark."""
    end = completions == ord(END)
    after = (torch.cumsum(end.int(), 1) - end.int()) > 0  # positions past the first end mark
    return (~after).float()


def run(cfg: Config, g: GRPOConfig, ctx: RankContext) -> list[dict]:
    task = Addition(g.digits)
    world, rank = ctx.world_size, ctx.rank
    g.check(world, ctx.dp_size, cfg.training.seq_length)  # (`fivefold rl` checked it before the ranks started)
    torch.manual_seed(g.seed)
    engine = Engine(cfg, ctx)
    rng = np.random.default_rng(g.seed)
    warm = _warmup(engine, task, g, ctx, rng)
    mbs = cfg.training.micro_batch_size  # the actor's and the reference's micro-batches (pipelined under PP)
    rollout, reference = _Rollout(cfg.model, seed=1), Engine(cfg, ctx, frozen=True)
    with engine.whole_weights():
        sync_weights(engine.model, reference.model)  # the warmed-up policy, frozen from here on
    rows = []
    with manual_gc(cfg.training):  # --manual-gc: the collector off while training
        for step in range(g.steps):
            t0 = time.perf_counter()
            synced = rollout.load(engine)
            pairs = task.sample(rng, g.prompts_per_step)[rank::world]
            prompts = _ids([task.prompt(a, b) for a, b in pairs]).repeat_interleave(g.group_size, 0)
            out = generate(rollout.model, prompts, task.answer_length, temperature=g.temperature,
                           seed=g.seed * 100_003 + step * 1009 + rank)
            rewards = torch.tensor([task.reward(a, b, _text(c)) for (a, b), c in
                                    zip([p for p in pairs for _ in range(g.group_size)], out.tokens)])
            ids = torch.cat([prompts, out.tokens], 1)
            p = task.prompt_length
            mask = torch.zeros_like(ids, dtype=torch.float32)
            mask[:, p:] = _response_mask(out.tokens)
            rollout_logp = torch.zeros_like(mask)
            rollout_logp[:, p:] = out.logprobs
            local = Batch(ids, mask, {"advantages": L.grpo_advantages(rewards, g.group_size),
                                      "old_logprobs": rollout_logp, "rewards": rewards})
            batch = _pool(local, ctx)  # this actor DP replica's rollouts, the same on each of its ranks
            batch.extra["ref_logprobs"] = reference.forward(batch, mbs).logprobs  # 0 at t = 0, as the others
            stats = dict.fromkeys(("kl", "entropy", "mismatch"), 0.0)  # (a rank without the last stage adds none)

            def loss_fn(s, mb, totals):
                x = mb.extra
                kl = L.kl_penalty(s.logprobs, x["ref_logprobs"], "k3")
                per_token = L.ppo_policy_loss(s.logprobs, x["old_logprobs"], x["advantages"], clip_low=g.clip,
                                              clip_high=g.clip) + g.kl_coef * kl
                for key, v in (("kl", kl), ("entropy", s.entropy),
                               ("mismatch", (s.logprobs - x["old_logprobs"]).abs())):
                    stats[key] += float(L.aggregate(v.detach(), mb.loss_mask, "token-mean", totals["tokens"]))
                return L.aggregate(per_token, mb.loss_mask, "token-mean", totals["tokens"])

            m = engine.train_batch(batch, loss_fn, lr=g.lr, micro_batch_size=mbs)
            summary = torch.tensor([float(rewards.sum()), float((rewards == 1).sum()), float(mask.sum()), len(rewards),
                                    stats["kl"], stats["entropy"], stats["mismatch"]], dtype=torch.float64)
            comm.all_reduce_(summary, ctx.mesh.world, tag="rl-metrics")
            n, copies = summary[3], ctx.layout.tp * ctx.layout.cp  # each last-stage TP and CP rank has them all
            rows.append({"step": step, "reward": float(summary[0] / n), "exact": float(summary[1] / n),
                         "response_length": float(summary[2] / n), "kl": float(summary[4] / copies),
                         "entropy": float(summary[5] / copies), "logprob_mismatch": float(summary[6] / copies),
                         "loss": m["loss"], "grad_norm": m["grad_norm"], "sync_bytes": synced,
                         "seconds": time.perf_counter() - t0, "warmup_loss": warm[-1] if warm else None,
                         **{k: v for k, v in m.items() if k.startswith("moe_")}})  # a MoE actor's load metrics
            after_step(cfg.training, step)  # --manual-gc-interval
    return rows


def _pool(local: Batch, ctx: RankContext) -> Batch:
    """The rollouts of every rank of this rank's actor DP replica (its TP and CP ranks, then its
    pipeline ranks), concatenated in that order on each of them: the ranks of a replica must hold the
    same sequences (CP splits their positions, PP runs their layers, TP their heads)."""
    def gather(t: torch.Tensor) -> torch.Tensor:
        for group in (ctx.mesh.group("tp-cp"), ctx.mesh.pp):
            if group.size > 1:
                t = comm.all_gather(t.contiguous(), 0, group, tag="rl-rollouts")
        return t
    return Batch(gather(local.input_ids), gather(local.loss_mask), {k: gather(v) for k, v in local.extra.items()})


def write(rows: list[dict], out: Path) -> Path:
    """metrics.jsonl and rl.png (reward, KL, entropy, mismatch over steps)."""
    with writing_file(out / "metrics.jsonl", "the RL run's metrics"):
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return plot_rl(rows, out / "rl.png")


RL_KEYS = ("reward", "kl", "entropy", "logprob_mismatch")
"""What rl.png draws over the GRPO steps; a metrics.jsonl whose rows hold them is an RL run's."""


def plot_rl(rows: list[dict], png: Path, title: str = "") -> Path:
    """rl.png: `RL_KEYS` over the GRPO steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    for ax, key in zip(axes, RL_KEYS):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o")
        ax.set_title(key)
        ax.set_xlabel("GRPO step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    from fivefold.train.metrics import save_figure
    save_figure(fig, png, "the RL curves; metrics.jsonl holds the numbers", dpi=80)
    return png
