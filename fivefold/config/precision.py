"""Mixed precision as Megatron holds it: which dtype the model's parameters, the gradients and the
optimizer use, and fp16's dynamic loss scaling. The one place that decides it (`Precision.of`).

                       parameters     gradients (accumulated, reduced)        main params + AdamW
  fp32                 fp32           fp32                                    the parameters themselves
  bf16 (--bf16)        bf16           fp32;  bf16 with --grad-reduce-in-bf16  fp32 copies
  fp16 (--fp16)        fp16           fp16;  fp32 with                        fp32 copies
                                      --accumulate-allreduce-grads-in-fp32
  counted by the planner, refused by the runtime (fivefold.config.supported):
  fp8                  bf16           fp32                                    fp32 copies
  + --fp8-param-gather fp8 (1 byte)   fp32                                    fp32 copies
  --exp-avg-dtype D,                                                          AdamW moments in D (fp32,
  --exp-avg-sq-dtype D                                                        bf16, fp16, fp8); both need
  --main-params-dtype                                                         fp16 copies with fp16;
                                                                              --use-precision-aware-optimizer

The model computes in its parameters' dtype (no autocast): norms, softmax, the router and the loss run
in fp32 inside the model code, as Megatron's kernels do. Gradients accumulate into a flat buffer of the
gradient dtype (`main_grad`, fivefold.parallel.data.reducer); when that dtype differs from the parameters', each
parameter's gradient is added into its buffer view as soon as backward produces it and freed. The
optimizer steps fp32 "main" parameters (under ZeRO-1 this rank's chunks of them;
fivefold.parallel.data.main_params) and copies the result back into the 16-bit parameters. Bytes per parameter, replicated: 2 (param) + 4 (fp32 grad) + 4 (main) +
8 (Adam moments) = 18; with the distributed optimizer over d ranks: 2 + 4 + 12/d (Megatron's 6 + 12/d
counts the fp32 gradient buffer as 4 bytes). The precision-aware optimizer's dtypes (--exp-avg-dtype,
--exp-avg-sq-dtype, --main-params-dtype: e.g. bf16 moments, 4 + 2 + 2 instead of 12) and fp8 primary
weights (--fp8-param-gather: 1 byte instead of 2) are counted for the planner; the runtime refuses
them (fivefold.config.supported). docs/precision.md has every variant.

fp16 loss scaling (Megatron's DynamicGradScaler): the loss is multiplied by the scale before backward;
after the gradients are reduced they are divided by it and checked; a step whose gradients hold an inf or
NaN on any rank is skipped on every rank. `LossScaler.update` then applies Megatron's rule: on an
overflow the growth count restarts and the hysteresis count drops, and when it reaches 0 the scale is
multiplied by 0.5 (not below --min-loss-scale); after --loss-scale-window clean steps in a row the scale
doubles and the hysteresis count is restored. `--loss-scale S` fixes the scale (overflow steps are still
skipped).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from fivefold.config.schema import TrainingConfig
from fivefold.frozen import hashed_once

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
"""Bytes per element of each dtype name. The policy is plain Python (the planner reads it without
torch); `Precision.param_dtype` / `grad_dtype` give the torch dtypes."""

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Gradient bucket capacity in bytes of parameters (PyTorch DDP's default 25 MiB;
fivefold.parallel.data.reducer; the planner sizes ZeRO's all-gather outputs by it)."""


def _torch_dtype(name: str):
    import torch  # here, not at the top: the planner reads the policy without loading torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass
class LossScaler:
    """fp16's loss scale: dynamic (Megatron's defaults) or static (`dynamic=False`)."""

    scale: float = 2.0 ** 32
    dynamic: bool = True
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    growth_tracker: int = 0
    hysteresis_tracker: int = field(default=-1)
    skipped: int = 0
    """Steps skipped for an overflow so far (metrics.jsonl's skipped_steps)."""

    def __post_init__(self):
        if self.hysteresis_tracker < 0:
            self.hysteresis_tracker = self.hysteresis

    @classmethod
    def of(cls, t: TrainingConfig) -> "LossScaler":
        if t.loss_scale is not None:
            return cls(scale=float(t.loss_scale), dynamic=False)
        return cls(scale=float(t.initial_loss_scale), min_scale=float(t.min_loss_scale),
                   window=t.loss_scale_window, hysteresis=t.hysteresis)

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` says whether any rank's gradients held an inf or NaN."""
        self.skipped += overflow
        if not self.dynamic:
            return
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skipped = int(state.get("skipped", 0))


@hashed_once
@dataclass(frozen=True)
class Precision:
    """The dtypes of one run (see the module docstring)."""

    name: str
    param: str
    """The parameters' dtype name (fp32, bf16, fp16)."""
    grad: str
    """The gradient buffers' dtype name."""
    offload_fraction: float = 0.0
    """--optimizer-cpu-offload: the share of the main parameters (and their AdamW state) kept and
    stepped in host memory (fivefold.parallel.data.data_parallel)."""
    main: str = "fp32"
    """The main parameters' dtype name (--main-params-dtype; counted by the planner only)."""
    moments: tuple[str, str] = ("fp32", "fp32")
    """AdamW's exp_avg and exp_avg_sq dtype names (--exp-avg-dtype, --exp-avg-sq-dtype; planner only)."""
    stored_param: str | None = None
    """The dtype the model stores its weights in when not `param`: fp8 under --fp8-param-gather."""

    @classmethod
    def of(cls, t: TrainingConfig, precision: str | None = None) -> "Precision":
        """The policy `t` asks for (config validation has refused the combinations that do not run).
        `precision`: instead of t.precision (the planner's fp8 keeps bf16 parameters, as
        TransformerEngine does)."""
        return _policy(precision or t.precision, t.grad_reduce_in_bf16, t.accumulate_allreduce_grads_in_fp32,
                       t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0, t.fp8_param_gather,
                       t.main_params_dtype, (t.exp_avg_dtype, t.exp_avg_sq_dtype))

    @property
    def param_dtype(self):
        return _torch_dtype(self.param)

    @property
    def grad_dtype(self):
        return _torch_dtype(self.grad)

    @property
    def has_main(self) -> bool:
        """Whether the optimizer keeps fp32 copies of the parameters (16-bit parameters)."""
        return self.param != "fp32"

    @property
    def scales_loss(self) -> bool:
        return self.param == "fp16"

    @lru_cache(maxsize=256)  # the planner asks the same few under thousands of layouts
    def state_bytes(self, dp_shards: int = 1, mode: str = "optim") -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes per parameter between steps, what the runtime holds
        and the planner counts, under data-parallel `mode` over `dp_shards` ranks: no_shard keeps all,
        optim (ZeRO-1) shards the optimizer state (fp32 main copy + AdamW moments), optim_grads
        (ZeRO-2) the gradients too, optim_grads_params (ZeRO-3) the parameters too. Each term is its
        dtype's bytes: fp8 primary weights 1, the optimizer state main (16-bit parameters only) +
        exp_avg + exp_avg_sq (e.g. 4 + 2 + 2 with bf16 moments)."""
        d = 1 if mode == "no_shard" else dp_shards
        sharded = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[mode]
        p, g = BYTES[self.stored_param or self.param], BYTES[self.grad]
        o = (BYTES[self.main] if self.has_main else 0) + sum(BYTES[m] for m in self.moments)
        return p / (d if sharded >= 3 else 1), g / (d if sharded >= 2 else 1), o / d

    def main_grad_copy_bytes(self, dp_shards: int = 1, mode: str = "optim") -> float:
        """Bytes per parameter alive while the optimizer steps, beyond `state_bytes`: with 16-bit
        gradients (bf16 gradients, fp16) each main parameter's gradient is an fp32 copy of its
        reduced 16-bit gradient (fivefold.parallel.data.main_params), sharded as the main parameters are."""
        return 0.0 if self.grad == "fp32" else 4 / (1 if mode == "no_shard" else dp_shards)

    def bytes_per_param(self, dp_shards: int = 1, mode: str = "optim") -> float:
        return sum(self.state_bytes(dp_shards, mode))


@lru_cache(maxsize=64)
def _policy(name: str, grad_reduce_in_bf16: bool, accumulate_fp32: bool, offload: float, fp8_param_gather: bool,
            main: str, moments: tuple[str, str]) -> Precision:
    """`Precision.of` from the fields it reads (one object per distinct policy: the planner asks for
    the same few under thousands of layouts)."""
    param = "bf16" if name == "fp8" else name
    if param == "bf16":
        grad = "bf16" if grad_reduce_in_bf16 else "fp32"
    elif param == "fp16":
        grad = "fp32" if accumulate_fp32 else "fp16"
    else:
        grad = "fp32"
    stored = "fp8" if name == "fp8" and fp8_param_gather else None
    return Precision(name, param, grad, offload, main=main, moments=moments, stored_param=stored)
