"""A canonical `Config` read as the numbers the estimates need (`Plan`), and the layer split.

Layers go to virtual stages i = chunk * pp + rank (Megatron's interleaving: rank r holds chunks
r, r + pp, r + 2pp, ...). The split is the foundation's `layers_per_stage` (Megatron's rule,
uneven first/last stages, embedding and loss counted as layers).
"""
from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.schema import Config
from fivefold.errors import UserError
from fivefold.config.rules import sizes_of, stage_layers
from fivefold.pipeline.schedules import REGISTRY
from fivefold.config.modules import OFFLOAD_MODULES, RECOMPUTE_MODULES


def split_key(config: Config) -> tuple:
    """What the layer split depends on."""
    p, n = config.parallel, config.model.num_layers
    return (n, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size, p.pipeline_schedule,
            tuple(p.pipeline_layers_per_stage or ()), p.decoder_first_pipeline_num_layers,
            p.decoder_last_pipeline_num_layers, p.account_for_embedding_in_pipeline_split,
            p.account_for_loss_in_pipeline_split)


def virtual_stage_layers(config: Config) -> list[int]:
    """Decoder layers per virtual stage, in virtual-stage order (length pp * vpp); ValueError if none."""
    key = split_key(config)
    if key not in _SPLITS:
        _SPLITS[key] = list(stage_layers(sizes_of(config)))
    return _SPLITS[key]


class cached_property:  # noqa: N801 (named as the functools one it replaces)
    """functools.cached_property without its per-instance lock (Python 3.11 takes one on every first
    read, a large share of the search's time); a Plan is read by one thread."""

    def __init__(self, func):
        self.func, self.name, self.__doc__ = func, func.__name__, func.__doc__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


_SPLITS: dict[tuple, list[int]] = {}
_GROUPS: dict[tuple, tuple] = {}
"""Plan.layer_key -> (the model, {rank: layer groups}): the search evaluates one split under many
micro-batch / optimizer variants, so the grouping is computed once per split, not once per Plan."""


_LAYOUT_ONLY = ("p", "tp", "sp", "cp", "cp_gathers_kv", "pp", "vpp", "ep", "etp", "world", "dp", "edp", "schedule",
                "placement")
"""Plan properties read from the cluster, model and parallel sections only, computed once per layout
for `Plan.with_training` (not `rank_chunks`: the layer groupings are cached by split, so most layouts
never read it)."""


@dataclass(frozen=True)
class Plan:
    """The resolved layout, batch and precision of one config."""

    config: Config

    @cached_property
    def p(self):
        return self.config.parallel

    @cached_property
    def tp(self) -> int:
        return self.p.tensor_model_parallel_size

    @cached_property
    def sp(self) -> bool:
        return self.p.sequence_parallel and self.tp > 1

    @cached_property
    def cp(self) -> int:
        return self.p.context_parallel_size

    @cached_property
    def cp_gathers_kv(self) -> bool:
        """All-gather context parallelism over more than one rank: each rank gathers the whole K and V."""
        return self.cp > 1 and self.p.cp_comm_type == "allgather"

    @cached_property
    def pp(self) -> int:
        return self.p.pipeline_model_parallel_size

    @cached_property
    def vpp(self) -> int:
        """Model chunks per pipeline rank: VPP for interleaving, 2 for DualPipeV's V, else 1."""
        return REGISTRY[self.schedule].chunks(self.p.virtual_pipeline_model_parallel_size)

    @cached_property
    def ep(self) -> int:
        return self.p.expert_model_parallel_size if self.config.model.is_moe else 1

    @cached_property
    def etp(self) -> int:
        if not self.config.model.is_moe:
            return 1
        e = self.p.expert_tensor_parallel_size
        return self.tp if e is None else e

    @cached_property
    def world(self) -> int:
        return self.config.cluster.resolved_world_size

    @cached_property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @cached_property
    def edp(self) -> int:
        return (self.tp * self.cp * self.dp) // (self.etp * self.ep)

    @cached_property
    def mbs(self) -> int:
        return self.config.training.micro_batch_size

    @cached_property
    def seq(self) -> int:
        return self.config.training.seq_length

    @cached_property
    def microbatches(self) -> int:
        t = self.config.training
        return t.global_batch_size // (t.micro_batch_size * self.dp)

    @cached_property
    def schedule(self) -> str:
        if self.pp == 1:
            return "1f1b"
        if self.p.virtual_pipeline_model_parallel_size and self.p.pipeline_schedule == "1f1b":
            return "interleaved"
        return self.p.pipeline_schedule

    @cached_property
    def group(self) -> int | None:
        """Interleaving's microbatches per group (Megatron's microbatch_group_size_per_vp_stage; None = PP)."""
        group = self.config.parallel.microbatch_group_size_per_vp_stage  # a search variant may set it
        return group if self.schedule == "interleaved" else None

    @cached_property
    def instances(self) -> int:
        """HSDP's distributed-optimizer instances (training.num_distributed_optimizer_instances): the
        DP x CP group sharded within each, replicated across; 1 without HSDP."""
        n = self.config.training.num_distributed_optimizer_instances
        return n if n > 1 and (self.dp * self.cp) % n == 0 else 1

    @cached_property
    def reduce_every_microbatch(self) -> bool:
        """ZeRO-2/3 reduce-scatter the gradients after every microbatch's backward into 1/d
        accumulators (ZeRO-3 gathering each unit again for every forward and backward): always without
        PP; under PP only on Megatron-FSDP (`training.use_megatron_fsdp`: megatron_fsdp.py's
        grad_reduce_every_bprop). Under PP our runtime and torch.distributed.pipelining's schedules keep
        whole gradient buffers (and units) for the step and reduce once."""
        t = self.config.training
        return t.sharding_strategy in ("optim_grads", "optim_grads_params") and (self.pp == 1 or t.use_megatron_fsdp)

    @cached_property
    def recompute(self) -> str | None:
        t = self.config.training
        return t.recompute_granularity

    @cached_property
    def recompute_modules(self) -> frozenset[str]:
        """What selective recompute recomputes (Megatron's --recompute-modules; default core_attn)."""
        modules = frozenset(self.config.training.recompute_modules or ("core_attn",))
        unknown = sorted(modules - RECOMPUTE_MODULES.keys())
        if unknown:
            raise UserError(f"training.recompute_modules: unknown {', '.join(unknown)}; Megatron's modules are "
                            + ", ".join(RECOMPUTE_MODULES))
        return modules

    @cached_property
    def offload_modules(self) -> frozenset[str]:
        """The modules whose inputs go to host memory (--fine-grained-activation-offloading)."""
        t = self.config.training
        modules = frozenset(t.offload_modules or ()) if t.fine_grained_activation_offloading else frozenset()
        unknown = sorted(modules - OFFLOAD_MODULES.keys())
        if unknown:
            raise UserError(f"training.offload_modules: unknown {', '.join(unknown)}; Megatron's modules are "
                            + ", ".join(OFFLOAD_MODULES))
        return modules

    @cached_property
    def precision(self) -> str:
        return self.config.training.precision

    @cached_property
    def placement(self) -> tuple[int, ...]:
        """Pipeline rank of each virtual stage (the schedule generators' placement)."""
        return REGISTRY[self.schedule].placement(self.pp, self.vpp)

    @property
    def first_rank(self) -> int:
        """The pipeline rank of the first virtual stage: it holds the embedding."""
        return self.placement[0]

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last virtual stage: it holds the head, the loss and MTP (rank 0
        under DualPipeV's V placement)."""
        return self.placement[-1]

    @cached_property
    def rank_chunks(self) -> list[list[range]]:
        """Per pipeline rank, its model chunks, each a range of decoder-layer indices."""
        counts = virtual_stage_layers(self.config)
        if len(counts) != self.pp * self.vpp or sum(counts) != self.config.model.num_layers:
            raise UserError(f"layer split {counts} does not give {self.config.model.num_layers} layers "
                            f"over {self.pp} x {self.vpp} stages")
        placement = self.placement
        chunks: list[list[range]] = [[] for _ in range(self.pp)]
        start = 0
        for i, n in enumerate(counts):
            chunks[placement[i]].append(range(start, start + n))
            start += n
        return chunks

    @cached_property
    def layer_key(self) -> tuple:
        """What `layer_groups` depends on (the model by identity)."""
        return id(self.config.model), split_key(self.config), self.schedule, self._recomputed_count()

    @cached_property
    def _groups(self) -> dict:
        entry = _GROUPS.get(self.layer_key)
        if entry is None or entry[0] is not self.config.model:
            entry = _GROUPS[self.layer_key] = (self.config.model, {})
        return entry[1]

    def with_training(self, config: Config) -> "Plan":
        """The Plan of `config`, whose cluster, model and parallel sections are this one's (the same
        objects) and whose training section differs: what depends on the layout alone is taken from
        here (the search evaluates each layout under several micro-batch / recompute variants)."""
        plan = Plan(config)
        plan.__dict__.update(self._layout_only)
        return plan

    @cached_property
    def _layout_only(self) -> dict:
        return {k: getattr(self, k) for k in _LAYOUT_ONLY}

    def layer_groups(self, rank: int) -> list[tuple[int, bool, int]]:
        """`rank`'s layers grouped by what their cost depends on: (a representative layer index,
        fully recomputed?, how many such layers). Dense and MoE layers differ; so do recomputed ones.
        The last rank also counts the multi-token prediction layers (model.mtp_num_layers), never
        recomputed, each of the model's last layer's kind."""
        groups = self._groups.get(rank)
        if groups is not None:
            return groups
        m = self.config.model
        k = m.moe_first_k_dense_layers if m.is_moe else m.num_layers
        n_rec = self._recomputed_count()
        counts: dict[tuple[bool, bool], list[int]] = {}
        pos = 0
        for chunk in self.rank_chunks[rank]:
            pieces = ((chunk.start, min(chunk.stop, k)), (max(chunk.start, k), chunk.stop))  # dense, then MoE
            for lo, hi in pieces:
                while lo < hi:  # split at the recompute boundary (block method)
                    rec = pos < n_rec
                    take = min(hi - lo, (n_rec - pos) if rec else hi - lo)
                    key = (lo >= k, rec)
                    entry = counts.setdefault(key, [lo, 0])
                    entry[1] += take
                    lo, pos = lo + take, pos + take
        if m.mtp_num_layers and rank == self.last_rank:  # MTP's layers, the last layer's kind, sit with the head
            entry = counts.setdefault((m.is_moe and m.num_layers >= k, False), [m.num_layers, 0])
            entry[1] += m.mtp_num_layers
        out = [(first, key[1], n) for key, (first, n) in counts.items()]
        self._groups[rank] = out
        return out

    def cached(self, key: tuple, compute):
        """`compute()`, kept with the layer groups: for what depends on the layer split and schedule
        (and on what `key` names besides)."""
        got = self._groups.get(key)
        if got is None:
            got = self._groups[key] = compute()
        return got

    @cached_property
    def rank_shapes(self) -> tuple:
        """Per pipeline rank, what its per-microbatch cost depends on: its layer groups by kind ((MoE?,
        recomputed?, count), in order), whether it is the first / last rank, and which of its chunks
        exchange activations with another rank (before, after). Ranks with equal shapes cost the same."""
        return self.cached(("shapes",), self._rank_shapes)

    @cached_property
    def rank_classes(self) -> tuple[int, ...]:
        """Per pipeline rank, the first rank of equal `rank_shapes` (itself when none before it)."""
        def first_of_each():
            first: dict[tuple, int] = {}
            return tuple(first.setdefault(shape, r) for r, shape in enumerate(self.rank_shapes))
        return self.cached(("classes",), first_of_each)

    def _rank_shapes(self) -> tuple:
        m, placement = self.config.model, self.placement
        k = m.moe_first_k_dense_layers if m.is_moe else m.num_layers
        out = []
        for rank in range(self.pp):
            kinds = tuple((i >= k, rec, n) for i, rec, n in self.layer_groups(rank))
            ends = tuple((s > 0 and placement[s - 1] != rank, s + 1 < len(placement) and placement[s + 1] != rank)
                         for s, r in enumerate(placement) if r == rank)
            out.append((kinds, rank == self.first_rank, rank == self.last_rank, ends))
        return tuple(out)

    def _recomputed_count(self) -> int:
        t = self.config.training
        if t.recompute_granularity != "full":
            return 0
        if t.recompute_method == "block":
            return (t.recompute_num_layers or 0) * self.vpp
        return self.config.model.num_layers
