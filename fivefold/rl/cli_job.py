"""The rank program of `fivefold rl`: GRPO (fivefold.rl.grpo), its metrics and plot on rank 0."""
from __future__ import annotations

from pathlib import Path


def grpo_job(raw: dict, out: Path):
    from fivefold.rl.grpo import GRPOConfig, run, write
    from fivefold.train.context import layout_text

    g = GRPOConfig.of(raw)

    def job(config, ctx) -> str:
        rows = run(config, g, ctx)
        if not ctx.is_main:
            return ""
        plot = write(rows, out)
        first, last = rows[0], rows[-1]
        tail = rows[-max(1, len(rows) // 4):]
        late = sum(r["reward"] for r in tail) / len(tail)
        warm = "none (grpo.warmup_steps=0)" if first["warmup_loss"] is None else f"{first['warmup_loss']:.4f}"
        return (f"GRPO {len(rows)} steps on {ctx.world_size} ranks (actor {layout_text(ctx.layout)}, rollout whole on every rank, "
                f"reference frozen in the actor's layout)\nwarm-up loss: {warm}\nreward: {first['reward']:.3f} at step 0 -> "
                f"{late:.3f} (mean of the last {len(tail)} steps); exact answers {first['exact']:.2f} -> "
                f"{last['exact']:.2f}\nKL {last['kl']:.4f}, entropy {last['entropy']:.3f}, train/rollout log-prob "
                f"mismatch {last['logprob_mismatch']:.2e}, synced {last['sync_bytes'] / 2**20:.1f} MiB per step, "
                f"{sum(r['seconds'] for r in rows) / len(rows):.2f} s per step\nmetrics: {out / 'metrics.jsonl'}   "
                f"plot: {plot}")
    return job
