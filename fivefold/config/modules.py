"""Megatron's --recompute-modules and --offload-modules: the names each flag takes and what each one
covers. Read by validation (a name must be known, and its switch on), the planner (what each saves or
offloads) and the runtime's recompute."""
from __future__ import annotations


RECOMPUTE_MODULES = {
    "core_attn": "the attention core (softmax(QK^T)V): its scores / softmax statistics are not kept",
    "mla_up_proj": "MLA's up-projections: q, k, v are recomputed from the kept latents",
    "layernorm": "the two norms of a layer: their outputs (the next linear's inputs) are not kept",
    "mlp": "a dense layer's MLP: only its input is kept",
    "moe_act": "the routed experts' activation function: its output (the down-projection's input) is not kept",
    "moe": "a MoE layer's whole MLP (router, dispatch, experts, combine): only its input is kept",
    "shared_experts": "the shared experts: only their input is kept",
}
"""Megatron's --recompute-modules, as the planner counts what each saves (per layer, selective)."""


def modules_not_in(model, modules) -> list[str]:
    """The recompute modules of `modules` that this model (a ModelConfig) has nothing for: each would
    recompute nothing and save nothing (a MoE module in a dense model, MLA's in a model without MLA)."""
    has = {"mla_up_proj": model.multi_latent_attention, "moe_act": model.is_moe, "moe": model.is_moe,
           "shared_experts": model.is_moe and bool(model.moe_shared_expert_intermediate_size)}
    return [x for x in modules if not has.get(x, True)]


OFFLOAD_MODULES = {
    "attn_norm": "attn norm input",
    "qkv_linear": "qkv input",
    "core_attn": "q, k, v",
    "attn_proj": "attention output (proj input)",
    "mlp_norm": "mlp norm input",
    "expert_fc1": "expert inputs",
    "moe_act": "expert fc1 outputs",
}
"""Megatron's --offload-modules (each offloads its input to host memory) -> the saved tensor that is
(`layer_activation_bytes`' key)."""
