"""The optimizer's main parameters: what AdamW steps for the model's tensors under a precision
policy (fivefold.config.precision) — the tensors themselves in fp32, fp32 copies for 16-bit
parameters and for the share offloaded to host memory (--optimizer-cpu-offload)."""
from __future__ import annotations

import torch
from torch import nn

from fivefold.config.precision import Precision

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

    def read_params(self) -> None:
        """Each copy refreshed from its tensor (after weights were loaded into the model)."""
        for t, main in zip(self.tensors, self.mains):
            if main is not t:
                main.detach().copy_(t.detach())

    def attach(self, grads: list[torch.Tensor]) -> None:
        """Each main's .grad: the reduced gradient of its tensor, a view when dtype and device agree,
        else an fp32 copy where the main lives."""
        for main, g in zip(self.mains, grads):
            main.grad = g if (g.dtype, g.device) == (main.dtype, main.device) else g.to(main.device, main.dtype)

    def write_back(self) -> None:
        """After the step: each copy cast back into its tensor, and its gradient dropped (an fp32 copy
        of a 16-bit gradient would otherwise live until the next step)."""
        pairs = [(t, main) for t, main in zip(self.tensors, self.mains) if main is not t]
        if pairs:
            with torch.no_grad():  # one multi-tensor copy on a GPU (a launch per tensor made its steps host-bound)
                torch._foreach_copy_([t for t, _ in pairs], [main for _, main in pairs])
        for _, main in pairs:
            main.grad = None
