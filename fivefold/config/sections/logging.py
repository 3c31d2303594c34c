"""logging: metric lines, TensorBoard / W&B, profiling and traces (a section of fivefold.config.schema.Config)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 1
    """Steps between metric lines. Default 1."""
    tensorboard: bool = True
    """Write TensorBoard logs when the package is installed. Default True."""
    tensorboard_dir: str | None = None
    """Where TensorBoard logs go (Megatron's --tensorboard-dir). Default None = OUT/tensorboard."""
    wandb_project: str | None = None
    """Also log to Weights & Biases, offline (files under OUT/wandb; `wandb sync` uploads them), in this
    project (--wandb-project). Needs the wandb package. Default None = off."""
    wandb_exp_name: str | None = None
    """The W&B run name (--wandb-exp-name). Default None = W&B's own."""
    profile: bool = False
    """Profile the first iterations (Megatron --profile). Default False."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks to profile. Default [0]."""
    trace_schedule: bool = False
    """With PP > 1: time every pipeline action of the last step and draw it (OUT/schedule_trace.png)
    as `fivefold schedule` draws a simulated one. Default False."""
    moe_per_layer_logging: bool = False
    """MoE: also log each MoE layer's tokens per expert, load imbalance, aux loss (and dropped fraction)
    per logged step, and draw OUT/expert_load.png at the end (--moe-per-layer-logging). Default False:
    the totals over layers only."""
