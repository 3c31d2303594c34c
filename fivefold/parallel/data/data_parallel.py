"""The data-parallel mode: one gradient and optimizer path for every parameter, dense or expert.

Modes (`DPMode`, Megatron's --data-parallel-sharding-strategy names):
  no_shard  replicate: each domain's gradients all-reduced in buckets (fivefold.parallel.data.reducer), one
            AdamW over every parameter;
  optim     ZeRO-1 (--use-distributed-optimizer): gradients reduce-scattered, AdamW state and update
            on this rank's chunk of each bucket, parameters all-gathered back
            (fivefold.parallel.data.distributed_optimizer), per domain;
  optim_grads  ZeRO-2 (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads): as optim,
            and the dense gradients reduce-scattered after every microbatch into a 1/d accumulator,
            a bucket's full buffer living only while backward fills it (fivefold.parallel.data.reducer). Under
            PP the schedule accumulates gradients itself, so the full buffers stay for the step and
            are reduce-scattered once (ZeRO-1's gradient memory). Expert buckets are reduced per
            MoE layer during backward (below), per microbatch too.
  optim_grads_params  ZeRO-3: as optim_grads, and the parameters sharded too, each unit (embedding,
            decoder layer, output layer) gathered before use with the next prefetched, freed after
            (fivefold.parallel.data.fsdp); under PP a unit stays whole from its first forward to the end
            of the step (TorchTitan's policy with PP), the gradients reduce-scattered once as above.

Gradient domains (ParamMeta.domain; Megatron's MoE folding puts the EP ranks inside TP x CP x DP):
  dense           summed over DP x CP (tag dp-grad);
  routed experts  summed over EDP, the ranks holding the same experts (same ETP and EP coordinate),
                  of size TP*CP*DP/(ETP*EP) (tag edp-grad). An expert's gradient already holds the
                  contributions of every token routed to it from the whole EP group (the dispatch
                  all-to-all's backward brought them), so its EDP sum is the global loss's gradient.
The dense buckets are reduced during the last backward as they complete. Which expert gradients are
complete when depends on the routing (an expert that got no token has none), so completion cannot
launch them; instead each MoE layer's experts are one bucket, launched by a hook on the layer's input
gradient: when backward has computed it, every expert gradient of the layer has been accumulated
(autograd accumulates a leaf's gradient as soon as it is ready), and every rank passes the layers in
the same order. The expert buckets use a communicator of their own ("edp-grad",
fivefold.runtime.mesh.OWN_COMMUNICATOR): EDP may be the very ranks of DP x CP (TP2 x DP2 with EP2 = TP:
EDP = DP), and on one communicator the dense and expert collectives would have to interleave in the
same order on every rank, which routing does not guarantee. Under PP the schedule's backward reduces
nothing; finish() reduces every bucket.

HSDP (training.num_distributed_optimizer_instances = N > 1, dense models): the sharded modes shard
within N instances of the DP x CP group (mesh.split) and all-reduce each reduced chunk over the N
ranks holding it (fivefold.parallel.data.reducer, `replicate`).

Precision (fivefold.config.precision, the one place that decides dtypes): the model's parameters
hold the parameter dtype (parallelize cast them); the reducers' buffers hold the gradient dtype; AdamW steps fp32 main
parameters (`MainParams`: the parameters themselves in fp32, copies for 16-bit parameters or offload),
which are cast back after each step. fp16 scales the loss by `loss_scale`; `unscale_grads` divides the
reduced gradients by it and decides, over the whole world, whether the step runs.

Gradient norm (`clip_grads`), each parameter counted once (ParamMeta.owns_grad), over the main
parameters (ZeRO: this rank's chunks, whose squares are also added over the domain's DP group):
  dense only:  squares added over TP x PP (the model-parallel group);
  with experts: ||g||^2 = ||dense||^2 (added over TP) + ||experts||^2 (added over ETP x EP, every ETP
               slice and expert distinct), then added over PP (both share the pipeline groups).
"""
from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.parallel.optimizer import OptimShard
from fivefold.config.schema import TrainingConfig
from fivefold.parallel.data.reducer import GradReducer
from fivefold.parallel.data.distributed_optimizer import DistributedOptimizer
from fivefold.parallel.data.fsdp import ParamSharding, units_of
from fivefold.parallel.optimizer import build_adamw, by_device, clip_grad_norm
from fivefold.parallel.param_meta import GradDomain, ParamMeta, metas_of
from fivefold.parallel.data.main_params import MainParams
from fivefold.config.precision import LossScaler, Precision
from fivefold.parallel.tensor.layers import reduce_tp_grads
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


class DPMode(enum.Enum):
    """How data parallelism holds gradients and optimizer state (Megatron's sharding strategy names)."""

    NO_SHARD = "no_shard"
    """Replicated: gradients all-reduced, full AdamW state on every rank."""
    OPTIM = "optim"
    """ZeRO-1: optimizer state and update sharded over the domain's DP group."""

    OPTIM_GRADS = "optim_grads"
    """ZeRO-2: gradients too, reduce-scattered after every microbatch into a 1/d accumulator; a bucket's
    full-size buffer exists only while backward fills it (see fivefold.parallel.data.reducer)."""
    OPTIM_GRADS_PARAMS = "optim_grads_params"
    """ZeRO-3: parameters too, gathered per unit (fivefold.parallel.data.fsdp)."""

    @classmethod
    def of(cls, training: TrainingConfig) -> "DPMode":
        return cls(training.sharding_strategy)


@dataclass
class _Domain:
    """The parameters one DP group reduces, with their reducer and (ZeRO-1) optimizer shard."""

    kind: GradDomain
    params: list[nn.Parameter]
    reducer: GradReducer
    norm_group: Group
    """Where this domain's squares are added (besides the ZeRO group): TP, ETP x EP, or TP x PP."""
    zero: DistributedOptimizer | None = None
    mains: MainParams | None = None
    """Without ZeRO: the main parameters of `params`, in order."""

    def main(self, of: Iterable[nn.Parameter] | None = None) -> list[torch.Tensor]:
        """What the optimizer steps, each holding its reduced gradient: ZeRO-1's chunks of the
        parameters `of` (default all), or their main parameters."""
        if self.zero is not None:
            return self.zero.main_params(of)
        if self.mains is None:
            return []
        ids = None if of is None else {id(p) for p in of}
        return [m for p, m in zip(self.params, self.mains.mains) if ids is None or id(p) in ids]

    def attach_grads(self) -> None:
        """After the reduction: each main parameter's .grad is its reduced gradient (fp32)."""
        if self.zero is not None:
            self.zero.attach_grads()
        elif self.mains is not None:  # None: ZeRO-1 with no parameter of this domain on this stage
            self.mains.attach([p.main_grad for p in self.params])


class _States:
    """`optimizer.state` of several optimizers as one mapping (the checkpoint code reads and writes it)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._owner = {id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]}
        self._optimizers = optimizers

    def get(self, key, default=None):
        return self._owner[id(key)].state.get(key, default)

    def __getitem__(self, key):
        return self._owner[id(key)].state[key]

    def __setitem__(self, key, value) -> None:
        self._owner[id(key)].state[key] = value

    def values(self):
        return [v for opt in self._optimizers for v in opt.state.values()]


class DataParallel:
    """This rank's gradient and optimizer path. Per step:
        dp.set_lr(lr); dp.zero_grad(); for each microbatch: dp.prepare(last); backward
        dp.finish(); norm = dp.clip_grads(max_norm); dp.step()
    It stands where torch.optim's optimizer does for checkpoints (`state`, `param_groups`)."""

    def __init__(self, model: nn.Module, mesh, training: TrainingConfig, *, moe: bool | None = None,
                 not_counted: Iterable[nn.Parameter] = (), reducer_cls: type[GradReducer] = GradReducer,
                 pipelined: bool = False, expert_layers: Iterable[nn.Module] = ()):
        """`moe`: the model has routed experts (on some rank: a pipeline stage may hold none, and
        still takes part in the expert domain's collectives); default: this rank holds experts.
        `not_counted`: parameters left out of the gradient norm (a tied embedding's second copy,
        counted where its first copy lives). `pipelined`: a pipeline schedule runs the backward (its
        weight passes accumulate the gradients themselves, without the reducer's hooks), so ZeRO-2
        keeps full gradient buffers during the step and reduce-scatters them once, in finish().
        `expert_layers`: the MoE layers, in forward order, whose routed experts' gradients are reduced
        as soon as backward has passed each (see the module docstring)."""
        self.mode = DPMode.of(training)
        self.precision = Precision.of(training)
        self.scaler = LossScaler.of(training) if self.precision.scales_loss else None
        self.tp, self.world = mesh.tp, mesh.world
        self.not_counted = list(not_counted)
        self.metas: dict[int, ParamMeta] = metas_of(model)
        zero3 = self.mode is DPMode.OPTIM_GRADS_PARAMS
        shard = self.mode is not DPMode.NO_SHARD
        grads = dict(grad_dtype=self.precision.grad_dtype)
        dense_group = mesh.group(GradDomain.DENSE.group)
        if training.num_distributed_optimizer_instances > 1:  # HSDP: shard within an instance
            dense_group, grads["replicate"] = mesh.split(GradDomain.DENSE.group,
                                                         training.num_distributed_optimizer_instances)
        if zero3:  # one bucket per unit, of the unit's dense parameters (experts: per MoE layer, below)
            units = [[p for p in ps if not self.metas[id(p)].is_expert] for _, ps in units_of(model)]
            grads["units"] = [u for u in units if u]
        dense_every = self._every_microbatch(dense_group, pipelined)
        params = list(model.parameters())
        experts = [p for p in params if self.metas[id(p)].is_expert]
        self._expert_sync = False
        self._expert_layers = [] if pipelined else self._hook_expert_layers(expert_layers)
        if experts if moe is None else moe:
            dense = [p for p in params if not self.metas[id(p)].is_expert]
            units = [ps for _, ps in self._expert_layers] if self._expert_layers else None
            expert_group = mesh.group("edp-grad")
            self.domains = [
                _Domain(GradDomain.DENSE, dense, reducer_cls(dense, dense_group, shard=shard, **grads,
                                                             per_microbatch=dense_every), mesh.tp),
                _Domain(GradDomain.EXPERT, experts,
                        reducer_cls(experts, expert_group, shard=shard, tag="edp-grad",
                                    per_microbatch=self._every_microbatch(expert_group, pipelined),
                                    **{**grads, "units": units, "replicate": None}), mesh.group("etp-ep"))]
            self.norm_over: Group | None = mesh.pp
            """With two domains: their norms are combined, then added over this group."""
        else:
            self.domains = [_Domain(GradDomain.DENSE, params, reducer_cls(params, dense_group, shard=shard, **grads,
                                                                          per_microbatch=dense_every),
                                    mesh.group("model-parallel"))]
            self.norm_over = None
        self.shardings = [ParamSharding(model, d.reducer, "edp-param" if d.kind is GradDomain.EXPERT else "dp-param",
                                        reshard_after_forward=not pipelined)
                          for d in self.domains if d.params] if zero3 else []
        """ZeRO-3: the parameters' gather / free cycle per domain (fivefold.parallel.data.fsdp)."""
        if shard:
            sharded = [d for d in self.domains if d.params]  # an expert domain may be empty on this stage
            for d in sharded:
                d.zero = DistributedOptimizer(model, d.reducer, training, precision=self.precision,
                                              tag="edp-param" if d.kind is GradDomain.EXPERT else "dp-param")
                self.metas.update(d.zero.metas)
            self.optimizers = [d.zero.optimizer for d in sharded]
            self._steps = [d.zero.step for d in sharded]
            self._optim_shards = [s for d in sharded for s in d.zero.optim_shards()]
        else:
            names = {id(p): n for n, p in model.named_parameters()}
            for d in self.domains:
                d.mains = MainParams(d.params, self.precision)
                self.metas.update({id(m): self.metas[id(p)] for p, m in zip(d.params, d.mains.mains)})
            pairs = [(p, m) for d in self.domains for p, m in zip(d.params, d.mains.mains)]
            # weight decay on parameters with >= 2 dims (not on norms' gains or biases), as Megatron
            self.optimizers = [build_adamw([m for p, m in pairs if p.ndim >= 2], [m for p, m in pairs if p.ndim < 2],
                                           training)]
            self._steps = [self._step_replicated]
            self._optim_shards = [OptimShard(names[id(p)], m, (0, p.numel())) for p, m in pairs]
        self.state = self.optimizers[0].state if len(self.optimizers) == 1 else _States(self.optimizers)
        """AdamW's state, keyed by the tensors it steps (`optim_shards()` says which)."""

    def _hook_expert_layers(self, expert_layers: Iterable[nn.Module]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """Each MoE layer's routed-expert parameters, in forward order, with a hook that reduces them
        as soon as backward has passed the layer (see the module docstring)."""
        layers = []
        for m in expert_layers:
            params = [p for p in m.parameters() if self.metas[id(p)].is_expert]
            if params:
                m.register_forward_pre_hook(lambda m, args, i=len(layers): self._watch_layer_input(i, args[0]))
                layers.append((m, params))
        return layers

    def _watch_layer_input(self, i: int, x: torch.Tensor) -> None:
        if x.requires_grad:
            x.register_hook(lambda grad: self._expert_layer_done(i))

    def _expert_layer_done(self, i: int) -> None:
        """Backward has computed MoE layer i's input gradient: every expert gradient of the layer has
        been accumulated (autograd runs gradient accumulation as soon as it is ready), on every rank,
        in the same layer order: launch the layer's bucket."""
        if self._expert_sync:
            reducer = self.domains[1].reducer
            reducer.launch(reducer.buckets[len(self._expert_layers) - 1 - i])

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def _every_microbatch(self, group, pipelined: bool) -> bool:
        """Whether a domain over `group` reduce-scatters after every microbatch: ZeRO-2/3 unless a
        pipeline schedule runs the backward. ZeRO-2 over one rank has nothing to shard (its 1/n
        accumulator would be the whole buffer): it keeps whole buffers for the step, as ZeRO-1 does,
        without per-microbatch buckets."""
        if pipelined or self.mode not in (DPMode.OPTIM_GRADS, DPMode.OPTIM_GRADS_PARAMS):
            return False
        return self.mode is DPMode.OPTIM_GRADS_PARAMS or group.size > 1

    @property
    def shards_state(self) -> bool:
        """Whether each DP rank holds a different part of the optimizer state (every rank saves its own)."""
        return self.mode is not DPMode.NO_SHARD

    def optim_shards(self) -> list[OptimShard]:
        """The ranges of parameters the optimizer keeps state for (checkpoints)."""
        return self._optim_shards

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    def zero_grad(self) -> None:
        for d in self.domains:
            d.reducer.zero_grad()

    def prepare(self, last: bool) -> None:
        """Before each microbatch's backward: dense buckets reduce during it when `last` (ZeRO-2: every
        microbatch, unless pipelined), expert buckets as backward passes their MoE layer (see the module
        docstring)."""
        for d in self.domains:
            d.reducer.prepare((last or d.reducer.per_microbatch) and d.kind is GradDomain.DENSE)
        experts = self.domains[-1].reducer  # (the dense one when the model has no experts)
        self._expert_sync = (last or experts.per_microbatch) and bool(self._expert_layers)
        for s in self.shardings:
            s.new_microbatch()

    @property
    def loss_scale(self) -> float:
        """What the step's loss is multiplied by before backward (fp16's loss scale; else 1)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def finish(self) -> None:
        """Reduce what backward did not (every expert bucket, unused buckets), dense first; wait;
        point the main parameters' gradients at the result."""
        for d in self.domains:
            d.reducer.finish()
        for s in self.shardings:
            s.end_step()
        for d in self.domains:
            d.attach_grads()

    def unscale_grads(self) -> bool:
        """After finish(), fp16: divide the main gradients by the loss scale and say whether the step
        may run: False when any rank's gradients hold an inf or NaN (all ranks get the same answer);
        the scaler is updated either way. Without loss scaling: True, no communication."""
        if self.scaler is None:
            return True
        bad = torch.zeros((), dtype=torch.float64)
        # torch.amp's multi-tensor unscale, a device at a time (offloaded main gradients live on the host)
        for device, grads in by_device(t.grad for d in self.domains for t in d.main() if t.grad is not None).items():
            found = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1.0 / self.scaler.scale,
                                                                                     device=device))
            bad += float(found)
        comm.all_reduce_(bad, self.world, tag="found-inf")
        overflow = float(bad) > 0
        self.scaler.update(overflow)
        return not overflow

    def clip_grads(self, max_norm: float) -> float:
        """After finish(): complete the gradients of TP-replicated parameters (SP norm gains, KV
        replicas), clip every main parameter's gradient by the global norm (0: measure only);
        returns the norm before clipping. See the module docstring for the groups."""
        tp_rank = self.tp.rank
        parts = []
        for d in self.domains:
            main = d.main()
            skip = {id(t) for t in d.main(self.not_counted)}
            if d.kind is GradDomain.DENSE:
                reduce_tp_grads([(t, self.metas[id(t)]) for t in main], self.tp)
            groups = ([d.zero.group] if d.zero is not None else []) + [d.norm_group]
            parts.append((main, groups,
                          lambda t, skip=skip: id(t) not in skip and self.metas[id(t)].owns_grad(tp_rank)))
        if self.norm_over is None:  # one domain: its groups already span TP x PP
            main, groups, counted = parts[0]
            return clip_grad_norm(main, max_norm, groups, counted=counted)
        total = torch.tensor(sum(clip_grad_norm(main, 0.0, groups, counted=counted) ** 2
                                 for main, groups, counted in parts), dtype=torch.float64)
        comm.all_reduce_(total, self.norm_over, tag="grad-norm")
        norm = math.sqrt(float(total))
        if max_norm > 0 and norm > max_norm:  # one multi-tensor multiply (a launch per tensor: host-bound GPU steps)
            torch._foreach_mul_([t.grad for main, _, _ in parts for t in main if t.grad is not None],
                                max_norm / (norm + 1e-6))
        return norm

    def step(self) -> None:
        """AdamW on the main parameters, cast back into the model's (ZeRO-1: then the updated chunks
        all-gathered)."""
        for step in self._steps:
            step()

    def _step_replicated(self) -> None:
        self.optimizers[0].step()
        for d in self.domains:
            d.mains.write_back()

    def full_params(self, writes: bool = False):
        """A context in which every parameter is whole (ZeRO-3 gathers them; else nothing to do): for
        checkpoints. `writes`: what is written into the parameters becomes this rank's chunks."""
        stack = contextlib.ExitStack()
        for s in self.shardings:
            stack.enter_context(s.full_params(writes))
        return stack

    def reload_mains(self) -> None:
        """After weights were written into the model (inside `full_params(writes=True)`): the main
        parameters copy them (a fresh start from loaded weights, no optimizer state)."""
        for d in self.domains:
            mains = d.zero.mains if d.zero is not None else d.mains
            if mains is not None:
                mains.read_params()

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this mode allocated besides the model's parameters and AdamW's state: gradient
        buffers and accumulators, flat parameter buffers and chunks, main parameters (memory
        accounting: fivefold.testing.measure)."""
        out = []
        for d in self.domains:
            for b in d.reducer.buckets:
                out += [t for t in (b.buffer, b.grad_shard, b.param_buffer, getattr(b, "param_shard", None))
                        if t is not None]
            mains = d.zero.mains if d.zero is not None else d.mains
            out += mains.mains if mains is not None else []
        return out

    def offloaded(self) -> list[torch.Tensor]:
        """The main parameters kept and stepped in host memory (--optimizer-cpu-offload)."""
        mains = [d.zero.mains if d.zero is not None else d.mains for d in self.domains if d.params]
        return [m for ms in mains for m, host in zip(ms.mains, ms.offloaded) if host]
