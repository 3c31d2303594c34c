"""How each parameter is held: one typed `ParamMeta` per parameter (nanotron's sharded-parameter
configs, Megatron's `tensor_model_parallel` / `allreduce` attributes, as one object).

A parallel layer creates its parameters together with their metadata (`new_param`), and every
reader asks for it by parameter: initialisation (cut a TP shard from the one-process value),
checkpoints (where a shard sits in the global tensor, which rows are vocabulary padding), the
gradient path (which group reduces a gradient, which TP gradients are summed, who counts a
gradient in the global norm), the distributed optimizer's main parameters, and the planner's
measured checks.

The metadata lives on the module that owns the parameter (`module._param_meta[local_name]`), not on
the tensor: `to_empty`, `.to(device)`, `p.data = ...` and the distributed optimizer's views replace
or alias tensors, but keep modules, so the metadata survives them without a list of attributes to
copy. `metas_of(model)` reads it back, keyed by the parameters as they are now.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Shard:
    """The parameter is `full.narrow(dim, start, length)` of the one-process parameter `full` (shape
    `full_shape`), split over the mesh group `group` ("tp" for dense layers, "etp" for experts)."""

    full_shape: tuple[int, ...]
    dim: int
    start: int
    length: int
    group: str = "tp"

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where the shard starts in the full tensor, per dim (the checkpoint's view of it)."""
        return tuple(self.start if d == self.dim else 0 for d in range(len(self.full_shape)))

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of the full tensor (a copy)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"full tensor of shape {tuple(full.shape)}, expected {self.full_shape}")
        return full.narrow(self.dim, self.start, self.length).clone()


@dataclass(frozen=True)
class KVReplica:
    """A whole KV head held by several TP ranks (TP > KV heads): its gradient is summed over them."""

    slot: int
    """The KV head this rank holds."""
    slots: int
    """KV heads in the model."""
    replicas: int
    """TP ranks holding each KV head (consecutive ranks)."""


class GradDomain(enum.Enum):
    """Which data-parallel group reduces the gradient (Megatron's MoE folding)."""

    DENSE = "dp-cp"
    """Summed over DP x CP."""
    EXPERT = "edp"
    """A routed expert: summed over the expert-data-parallel group, normed over ETP x EP."""

    @property
    def group(self) -> str:
        """The mesh group's name."""
        return self.value


@dataclass(frozen=True)
class ParamMeta:
    """How one parameter is held on this rank; the default is a plain replicated dense parameter."""

    shard: Shard | None = None
    """A slice of the one-process parameter (TP / ETP); None: this rank holds it whole."""
    tp_grad_sum: bool = False
    """Replicated over TP, but each rank's gradient covers only its own tokens (norms under SP, the
    router): the gradients are summed over TP after backward."""
    kv_replica: KVReplica | None = None
    """A KV head replicated over some TP ranks: gradients summed over those ranks."""
    vocab_rows: int | None = None
    """A vocabulary matrix: rows at or past this are padding (zero; checkpoints may pad otherwise)."""
    domain: GradDomain = GradDomain.DENSE
    """Dense or routed expert: which group reduces the gradient."""

    @property
    def is_expert(self) -> bool:
        return self.domain is GradDomain.EXPERT

    def owns_grad(self, tp_rank: int) -> bool:
        """Whether this rank counts the gradient in the global norm: experts and split parameters on
        every rank (each a distinct slice), a KV replica on the first rank of its replicas, any other
        TP-replicated parameter on TP rank 0 only."""
        if self.is_expert:
            return True
        if self.kv_replica is not None:
            return tp_rank % self.kv_replica.replicas == 0
        return self.shard is not None or tp_rank == 0

    def placement(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global shape, offsets) of a tensor of `shape` held this way: where it sits in the
        one-process tensor."""
        if self.shard is not None:
            return self.shard.full_shape, self.shard.offsets
        return tuple(shape), tuple(0 for _ in shape)


PLAIN = ParamMeta()


def set_meta(module: nn.Module, name: str, **fields) -> None:
    """Set fields of the metadata of `module`'s own parameter `name` (the others keep their value)."""
    table = module.__dict__.setdefault("_param_meta", {})
    table[name] = dataclasses.replace(table.get(name, PLAIN), **fields)


def new_param(module: nn.Module, name: str, shape: tuple[int, ...], *, dtype=None, device=None,
              **fields) -> nn.Parameter:
    """Register an empty parameter `name` on `module` together with its metadata."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    module.register_parameter(name, p)
    set_meta(module, name, **fields)
    return p


def mark_all(module: nn.Module, where: Callable[[ParamMeta], bool] = lambda m: True, **fields) -> None:
    """Set `fields` on every parameter under `module` whose current metadata satisfies `where`."""
    for sub in module.modules():
        table = sub.__dict__.get("_param_meta", {})
        for name in sub._parameters:
            if where(table.get(name, PLAIN)):
                set_meta(sub, name, **fields)


def metas_of(model: nn.Module) -> dict[int, ParamMeta]:
    """id(parameter) -> its metadata, for every parameter under `model` (PLAIN where none was set).
    A parameter shared by two modules (a tied output layer) takes the first module's."""
    out: dict[int, ParamMeta] = {}
    for sub in model.modules():
        table = sub.__dict__.get("_param_meta", {})
        for name, p in sub._parameters.items():
            if p is not None:
                out.setdefault(id(p), table.get(name, PLAIN))
    return out


def named_metas(model: nn.Module) -> dict[str, ParamMeta]:
    """Parameter name (as model.named_parameters() gives it) -> its metadata."""
    by_id = metas_of(model)
    return {n: by_id.get(id(p), PLAIN) for n, p in model.named_parameters()}
