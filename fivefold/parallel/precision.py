"""Mixed precision as Megatron holds it: which dtype the model's parameters, the gradients and the
optimizer use, and fp16's dynamic loss scaling. The one place that decides it (`Precision.of`).

                       parameters     gradients (accumulated, reduced)        main params + AdamW
  fp32                 fp32           fp32                                    the parameters themselves
  bf16 (--bf16)        bf16           fp32;  bf16 with --grad-reduce-in-bf16  fp32 copies
  fp16 (--fp16)        fp16           fp16;  fp32 with                        fp32 copies
                                      --accumulate-allreduce-grads-in-fp32

The model computes in its parameters' dtype (no autocast): norms, softmax, the router and the loss run
in fp32 inside the model code, as Megatron's kernels do. Gradients accumulate into a flat buffer of the
gradient dtype (`main_grad`, fivefold.parallel.data); when that dtype differs from the parameters', each
parameter's gradient is added into its buffer view as soon as backward produces it and freed. The
optimizer steps fp32 "main" parameters (under ZeRO-1 this rank's chunks of them) and copies the result
back into the 16-bit parameters. Bytes per parameter, replicated: 2 (param) + 4 (fp32 grad) + 4 (main) +
8 (Adam moments) = 18; with the distributed optimizer over d ranks: 2 + 4 + 12/d (Megatron's 6 + 12/d
counts the fp32 gradient buffer as 4 bytes). docs/precision.md has every variant.

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

import torch
from torch import nn

from fivefold.config.schema import TrainingConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run (see the module docstring)."""

    name: str
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    offload_fraction: float = 0.0
    """--optimizer-cpu-offload: the share of the main parameters (and their AdamW state) kept and
    stepped in host memory (fivefold.parallel.data_parallel)."""

    @classmethod
    def of(cls, t: TrainingConfig) -> "Precision":
        """The policy `t` asks for (config validation has refused the combinations that do not run)."""
        param = DTYPES[t.precision]
        if t.precision == "bf16":
            grad = torch.bfloat16 if t.grad_reduce_in_bf16 else torch.float32
        elif t.precision == "fp16":
            grad = torch.float32 if t.accumulate_allreduce_grads_in_fp32 else torch.float16
        else:
            grad = torch.float32
        offload = t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0
        return cls(t.precision, param, grad, offload)

    @property
    def has_main(self) -> bool:
        """Whether the optimizer keeps fp32 copies of the parameters (16-bit parameters)."""
        return self.param_dtype != torch.float32

    @property
    def scales_loss(self) -> bool:
        return self.param_dtype == torch.float16

    def bytes_per_param(self, dp_shards: int = 1) -> float:
        """Parameter + gradient + main + AdamW bytes per parameter with the optimizer state sharded
        over `dp_shards` ranks (1: replicated): the model state the runtime holds between steps."""
        p = self.param_dtype.itemsize
        g = self.grad_dtype.itemsize
        main = 4 if self.has_main else 0
        return p + g + (main + 8) / dp_shards


HOST = torch.device("cpu")


class MainParams:
    """What AdamW steps for a list of model tensors (parameters, or ZeRO-1's chunks of them): each
    tensor itself when it is fp32 and stays on its device, else an fp32 copy (16-bit parameters; the
    offloaded share, on the host). Per step: `attach(grads)` after the reduction, AdamW steps `mains`,
    `write_back()` copies every copy back into its model tensor (cast)."""

    def __init__(self, tensors: list[torch.Tensor], precision: Precision):
        budget = precision.offload_fraction * sum(t.numel() for t in tensors)
        self.tensors = tensors
        self.mains: list[torch.Tensor] = []
        self.offloaded: list[bool] = []
        """Per tensor: its main lives in host memory (--optimizer-cpu-offload); the first tensors in
        optimizer order, up to optimizer_offload_fraction of the elements (Megatron's split)."""
        placed = 0
        for t in tensors:
            host = placed + t.numel() <= budget + 0.5 and budget > 0
            placed += t.numel() if host else 0
            copy = host or t.dtype != torch.float32
            main = nn.Parameter(t.detach().to(HOST if host else t.device, torch.float32, copy=True)) if copy else t
            self.mains.append(main)
            self.offloaded.append(host)

    def attach(self, grads: list[torch.Tensor]) -> None:
        """Each main's .grad: the reduced gradient of its tensor, a view when dtype and device agree,
        else an fp32 copy where the main lives."""
        for main, g in zip(self.mains, grads):
            main.grad = g if (g.dtype, g.device) == (main.dtype, main.device) else g.to(main.device, main.dtype)

    def write_back(self) -> None:
        for t, main in zip(self.tensors, self.mains):
            if main is not t:
                t.detach().copy_(main.detach())
