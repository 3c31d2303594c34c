"""Gradients of a MoE model: routed experts are reduced over EDP, everything else over DP x CP.

Megatron's MoE folding puts the EP ranks inside TP x CP x DP: the ranks that hold the same experts
(same ETP and EP coordinate) form the expert-data-parallel group EDP, of size TP*CP*DP/(ETP*EP).
An expert's gradient already holds the contributions of every token routed to it from the whole EP
group (the dispatch all-to-all's backward brought them), so summing it over EDP gives the gradient
of the global loss, as summing a dense gradient over DP x CP does.

Gradient norm, each parameter counted once:
  ||g||^2 = [dense: squares summed over TP (owners only) (+ over DP x CP under ZeRO-1)]
          + [experts: squares summed over ETP x EP (every ETP slice and expert is distinct)
                      (+ over EDP under ZeRO-1)]
  then added over PP (the dense and expert grids share their pipeline groups).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from fivefold.checkpoint.optim_state import OptimShard
from fivefold.config.schema import TrainingConfig
from fivefold.parallel.data import GradReducer
from fivefold.parallel.distributed_optimizer import DistributedOptimizer
from fivefold.parallel.param_meta import ParamMeta, metas_of
from fivefold.parallel.tensor import reduce_tp_grads
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group
from fivefold.train.optim import clip_grad_norm


class GradReducers:
    """The dense GradReducer (DP x CP, tag dp-grad) and the experts' (EDP, tag edp-grad), driven as one.

    The dense buckets are reduced during the last backward as they complete; the expert buckets
    only in finish(), after the dense ones. Which expert gradients are complete when depends on the
    routing (an expert that got no token has none), so launching them from backward hooks would
    issue collectives in a different order on different ranks — and EDP may be the very process
    group of DP x CP (TP2 x DP2 with EP2 = TP: EDP = DP), where the order must match."""

    def __init__(self, dense: GradReducer, expert: GradReducer):
        self.dense, self.expert = dense, expert
        self.shard = dense.shard

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.expert.zero_grad()

    def prepare(self, last: bool) -> None:
        self.dense.prepare(last)
        self.expert.prepare(False)  # launched in finish(), in bucket order

    def finish(self) -> None:
        self.dense.finish()
        self.expert.finish()


def build_reducers(model: nn.Module, mesh, *, shard: bool,
                   reducer_cls: type[GradReducer] = GradReducer) -> GradReducer | GradReducers:
    """One GradReducer over DP x CP for a dense model; GradReducers when `model` has routed experts."""
    params = [p for p in model.parameters()]
    metas = metas_of(model)
    experts = [p for p in params if metas[id(p)].is_expert]
    if not experts:
        return reducer_cls(params, mesh.dp_cp, shard=shard)
    dense = [p for p in params if not metas[id(p)].is_expert]
    return GradReducers(reducer_cls(dense, mesh.dp_cp, shard=shard),
                        reducer_cls(experts, mesh.edp, shard=shard, tag="edp-grad"))


class _JointState:
    """optimizer.state of both ZeRO-1 optimizers, as the checkpoint code reads and writes it."""

    def __init__(self, dense: DistributedOptimizer, expert: DistributedOptimizer):
        self.parts = (dense, expert)
        self._expert_keys = {id(pc.tensor) for pc in expert.pieces}

    def _owner(self, key) -> DistributedOptimizer:
        return self.parts[1] if id(key) in self._expert_keys else self.parts[0]

    def get(self, key, default=None):
        return self._owner(key).state.get(key, default)

    def __getitem__(self, key):
        return self._owner(key).state[key]

    def __setitem__(self, key, value) -> None:
        self._owner(key).state[key] = value

    def values(self):
        return [v for opt in self.parts for v in opt.state.values()]


class ExpertDistributedOptimizer:
    """ZeRO-1 for a MoE model: dense parameters' chunks over DP x CP, experts' over EDP (tag edp-param)."""

    def __init__(self, model: nn.Module, reducers: GradReducers, training: TrainingConfig):
        self.dense = DistributedOptimizer(model, reducers.dense, training)
        self.expert = DistributedOptimizer(model, reducers.expert, training, tag="edp-param")
        self.state = _JointState(self.dense, self.expert)

    @property
    def param_groups(self) -> list[dict]:
        return self.dense.param_groups + self.expert.param_groups

    def step(self) -> None:
        self.dense.step()
        self.expert.step()

    def optim_shards(self) -> list[OptimShard]:
        return self.dense.optim_shards() + self.expert.optim_shards()


def is_zero(optimizer) -> bool:
    return isinstance(optimizer, (DistributedOptimizer, ExpertDistributedOptimizer))


def _sq(params: list[nn.Parameter], groups: list[Group], counted: Callable[[nn.Parameter], bool]) -> float:
    """Sum of squares of the counted gradients, added over `groups` (clip_grad_norm measuring only)."""
    return clip_grad_norm(params, 0.0, groups, counted=counted) ** 2


def finish_moe_grads(params: Iterable[nn.Parameter], clip_grad: float, *, metas: dict[int, ParamMeta],
                     tp: Group | None, pp: Group, expert_mp: Group, not_counted: Iterable[nn.Parameter] = (),
                     optimizer=None) -> float:
    """train.step.finish_grads for a model with routed experts (see the module docstring); returns
    the norm before clipping. `expert_mp`: the ETP x EP group."""
    params = list(params)
    dense = [p for p in params if not metas[id(p)].is_expert]
    experts = [p for p in params if metas[id(p)].is_expert]
    dense_groups, expert_groups = [tp] if tp is not None else [], [expert_mp]
    if isinstance(optimizer, ExpertDistributedOptimizer):
        not_counted = optimizer.dense.main_params(not_counted)
        dense, experts = optimizer.dense.main_params(dense), optimizer.expert.main_params(experts)
        dense_groups, expert_groups = [optimizer.dense.group, *dense_groups], [optimizer.expert.group, expert_mp]
        metas = {**metas, **optimizer.dense.metas, **optimizer.expert.metas}
    if tp is not None:
        reduce_tp_grads([(p, metas[id(p)]) for p in dense], tp)
    skip, tp_rank = {id(p) for p in not_counted}, tp.rank if tp is not None else 0
    sq = _sq(dense, dense_groups, lambda p: id(p) not in skip and metas[id(p)].owns_grad(tp_rank))
    sq += _sq(experts, expert_groups, lambda p: True)
    total = torch.tensor(sq, dtype=torch.float64)
    comm.all_reduce_(total, pp, tag="grad-norm")
    norm = math.sqrt(float(total))
    if clip_grad > 0 and norm > clip_grad:
        scale = clip_grad / (norm + 1e-6)
        for p in dense + experts:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
