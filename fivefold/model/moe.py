"""The Mixture-of-Experts MLP (Mixtral / Megatron-Core MoELayer):

    y_t = sum_{e in topk(t)} w_te * SwiGLU_e(x_t)   [routed experts, width moe_ffn_hidden_size]
        + SwiGLU_shared(x_t)                         [shared experts, always on, if configured]

Routing and the auxiliary losses: fivefold.model.router. Token dispatch to experts on other EP
ranks, and ETP: fivefold.parallel.expert.dispatch. The layer works on this rank's tokens: under sequence
parallelism (and context parallelism) the input already is the rank's (b, s/tp, h) shard; with TP
but no SP (EP must then be 1) the replicated input is split along the sequence here and the output
all-gathered, so that every TP rank routes a different s/tp of the tokens, as under SP.

Parameter names keep the expert's global index (`layers.3.mlp.experts.5.gate_proj.weight`), so an
EP rank holds exactly the one-process experts it owns and checkpoints move between EP sizes.
The aux loss reaches the gradient through router.AttachAuxLoss on the layer's output.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.config.schema import ROUTER_SCORE_FUNCTIONS, Config, ModelConfig
from fivefold.errors import NotImplementedYet, UserError
from fivefold.capacity import padded_size
from fivefold.model.capacity import within_capacity
from fivefold.model.mlp import SwiGLU, dense_mlp
from fivefold.model.recompute import is_recomputing
from fivefold.model.router import AttachAuxLoss, Router, count_load, update_expert_bias
from fivefold.parallel.expert.dispatch import local_experts, moe_forward, use_grouped_gemm
from fivefold.parallel.param_meta import GradDomain, mark_all
from fivefold.parallel.tensor.layers import TPMode, mark_sequence_sharded
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group
from fivefold.config.supported import unsupported

SEQ_DIM = 1


def _real(group: Group | None) -> Group | None:
    return group if group is not None and group.size > 1 else None


@dataclass(frozen=True)
class MoEGroups:
    """The groups a MoE layer talks over (None or one rank: that dimension is off)."""

    ep: Group | None = None
    """Expert parallel: experts split over it, tokens all-to-all."""
    etp: Group | None = None
    """Expert tensor parallel: each expert's linears split over it."""
    tokens: Group | None = None
    """TP x CP: the ranks holding the shards of one micro-batch (aux-loss token counts are summed)."""

    @classmethod
    def of(cls, mesh) -> "MoEGroups":
        if mesh is None:
            return cls()
        return cls(_real(mesh.ep), _real(mesh.etp), _real(mesh.group("tp-cp")))


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.is_moe and layer >= cfg.moe_first_k_dense_layers


class MoE(nn.Module):
    """Router, this EP rank's routed experts (ModuleDict keyed by global index), optional shared experts."""

    def __init__(self, cfg: ModelConfig, tp: Group | None = None, mode: TPMode = TPMode.ALL_REDUCE,
                 groups: MoEGroups = MoEGroups(), layer: int = 0):
        super().__init__()
        self.cfg, self.tp, self.mode, self.groups = cfg, _real(tp), mode, groups
        self.aux_loss_scale = 1.0
        """Gradient of the aux loss per micro-batch (Decoder sets micro_batch / global_batch)."""
        self.layer = layer
        """The decoder layer's global index: its row of `layer_totals`."""
        self.step_totals: torch.Tensor | None = None
        """(3 + E,) float64 on the device: aux loss x aux_loss_scale, assignments dropped, assignments
        made, then the assignments each expert took (after token dropping), summed over the forwards
        since `reset_step_totals` (a recompute during backward is not counted again); None before the first."""
        h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.ffn_size
        self.router = Router(cfg)
        if self.tp is not None:  # replicated over TP, but each rank routes only its own tokens
            mark_sequence_sharded(self.router)
        etp = groups.etp
        self.experts = nn.ModuleDict({
            str(e): SwiGLU(h, f, etp, TPMode.SEQUENCE_PARALLEL) for e in local_experts(cfg.num_experts, groups.ep)})
        mark_all(self.experts, domain=GradDomain.EXPERT)  # reduced over EDP, normed over ETP x EP
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = SwiGLU(h, shared, tp, mode) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s', h) -> (b, s', h), s' as the rest of the layer holds it (s, s/tp under SP, s/cp)."""
        split = self.tp is not None and self.mode is TPMode.ALL_REDUCE
        x_own = comm.split(x, SEQ_DIM, self.tp, "tp") if split else x  # (b, s_r, h): this rank's tokens
        b, s_r, h = x_own.shape
        tokens = x_own.reshape(b * s_r, h)  # (n, h)
        routing = self.router(tokens, b, self.groups.tokens)
        keep = pad_to = None
        cfg = self.cfg
        if cfg.moe_expert_capacity_factor is not None:  # this rank's tokens compete (fivefold.model.capacity)
            keep = within_capacity(routing.experts, routing.weights, cfg.num_experts, cfg.moe_expert_capacity_factor,
                                   cfg.moe_token_drop_policy, b)
            if cfg.moe_pad_expert_input_to_capacity:
                pad_to = padded_size(len(tokens), cfg.moe_router_topk, cfg.num_experts, cfg.moe_expert_capacity_factor)
        kept = routing.experts if keep is None else routing.experts[keep]  # (n_kept,) or (n, k)
        count_load(self.router, kept)
        y = moe_forward(tokens, routing.experts, routing.weights, list(self.experts.values()),
                        cfg.num_experts, self.groups.ep, self.groups.etp, keep, pad_to,
                        use_grouped_gemm(cfg.moe_grouped_gemm, tokens.device))  # (n, h)
        if routing.loss is not None:
            y = AttachAuxLoss.apply(y, routing.loss, self.aux_loss_scale)
        if not is_recomputing():  # a forward, not its rerun during backward
            term = torch.zeros(3 + cfg.num_experts, dtype=torch.float64, device=y.device)  # no host sync
            if routing.loss is not None:
                term[0] = routing.loss.detach().double() * self.aux_loss_scale
            if keep is not None:
                term[1], term[2] = (~keep).sum(), keep.numel()
            hits = kept.reshape(-1)
            term[3:].index_add_(0, hits, torch.ones(hits.shape, dtype=torch.float64, device=y.device))
            self.step_totals = term if self.step_totals is None else self.step_totals + term
        y = y.view(b, s_r, h)
        if split:
            y = comm.gather_split(y, SEQ_DIM, self.tp, "tp")  # (b, s, h)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def build_mlp(cfg: ModelConfig, layer: int, tp: Group | None, mode: TPMode, groups: MoEGroups | None) -> nn.Module:
    """The MLP of decoder layer `layer`: MoE, or the dense SwiGLU for dense models and the first
    moe_first_k_dense_layers layers of a MoE model."""
    if is_moe_layer(cfg, layer):
        return MoE(cfg, tp, mode, groups or MoEGroups(), layer)
    return dense_mlp(cfg, tp, mode)


_MOE_LAYERS: "weakref.WeakKeyDictionary[nn.Module, list[MoE]]" = weakref.WeakKeyDictionary()


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model` in module order, found once per model (its module tree is fixed once
    built): a walk over every module is ~2 ms for 7 layers of 64 experts (1,914 modules) on this
    project's CPU, and a training step asked for it three times."""
    found = _MOE_LAYERS.get(model)
    if found is None:
        found = _MOE_LAYERS[model] = [m for m in model.modules() if isinstance(m, MoE)]
    return found


def reset_step_totals(model: nn.Module) -> None:
    for m in moe_layers(model):
        m.step_totals = None


def layer_totals(model: nn.Module, layers: int, experts: int) -> torch.Tensor:
    """(layers, 3 + E) float64: row l holds decoder layer l's `MoE.step_totals` since
    `reset_step_totals` (aux loss, assignments dropped, assignments made, assignments per expert);
    zeros for a dense layer and for layers this rank does not hold (another pipeline stage). The
    aux term of each forward is its aux + z loss x aux_loss_scale, so, added over every rank (TP / CP
    shards, DP micro-batches, PP stages), the first column is the mean over the step's micro-batches of
    the layer's aux loss; the counts add up likewise (each rank routes its own tokens)."""
    device = next(model.parameters()).device
    out = torch.zeros(layers, 3 + experts, dtype=torch.float64, device=device)  # the same shape on every rank
    for m in moe_layers(model):
        if m.layer >= layers:
            raise ValueError(f"MoE layer {m.layer} has no row among {layers} (layer_totals(model, layers, experts))")
        if m.step_totals is not None:
            out[m.layer] += m.step_totals
    return out


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient each micro-batch's aux loss gets (see router.AttachAuxLoss)."""
    for m in moe_layers(model):
        m.aux_loss_scale = scale


def update_expert_biases(model: nn.Module, group: Group | None) -> None:
    """After a training step's backward (collective over `group`, the TP x CP x DP ranks of this
    pipeline stage): every MoE layer's expert bias moves by the step's load (router.update_expert_bias).
    Megatron does it in finalize_model_grads, so also on a step that fp16 overflow then skips."""
    update_expert_bias([m.router for m in moe_layers(model)], group)


def check_moe_supported(cfg: ModelConfig) -> None:
    """Refuse the MoE settings this runtime does not build (NotImplementedYet: exit 2): the model rows
    of fivefold.config.supported, the one table of unbuilt knobs."""
    problems = [p for p in unsupported(Config(model=cfg)) if p.startswith("model.")]
    if problems:
        raise NotImplementedYet("fivefold.model: " + "; ".join(problems))
    if cfg.moe_router_score_function not in ROUTER_SCORE_FUNCTIONS:
        raise UserError(f"moe_router_score_function={cfg.moe_router_score_function!r}: one of "
                        f"{', '.join(ROUTER_SCORE_FUNCTIONS)}")
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function == "softmax":
        raise UserError("moe_router_enable_expert_bias needs moe_router_score_function sigmoid or sqrtsoftplus "
                        "(Megatron-LM refuses softmax too)")