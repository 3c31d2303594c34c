"""Our MoE decoder and MoE layer against HF transformers with the same weights, fp32 on CPU.

- Mixtral (MixtralForCausalLM): the whole model — logits, loss, every gradient; and, on one
  layer, the load-balancing loss's gradient (HF adds router_aux_loss_coef * its aux loss to the
  loss; with one layer HF's loss is k times Megatron's, so our coeff = k * HF's coef).
- The MoE layer alone against two independent HF blocks whose math is one of our settings:
  OLMoE's OlmoeSparseMoeBlock (softmax, top-k NOT renormalised: moe_router_pre_softmax) and
  DeepSeek-V3's DeepseekV3MoE (sigmoid scores, top-k renormalised, shared experts always on and
  added), with one group and routed_scaling_factor 1, and with its own routing: groups, the
  e_score_correction_bias (our expert bias) and routed_scaling_factor — Qwen2-MoE is not used: its
  shared expert is multiplied by a sigmoid gate, which Megatron's shared experts (and ours) do not have.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, MixtralConfig, MixtralForCausalLM, OlmoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.model import Decoder
from fivefold.hf.names import hf_name
from fivefold.model.moe import MoE
from fivefold.model.init import init_parameters_

# Same budget as tests/test_model_hf.py (fp32, same math, different kernels and summation orders:
# a few ulps per op). Routing is a discrete choice: the top-2 margins of these seeds are > 1e-3
# (checked below), 100x the fp32 noise of scores ~0.25 (~1e-7), so both sides route every token identically.
# Measured worst over the CPU kernel settings (docs/tolerances.md), as fractions of each bound: Mixtral
# logits 0.0099, gradients 0.036 (28x); the MoE blocks' outputs 0.0092, gradients 0.22 (4.5x; the router
# weight's gradient under DeepSeek-V3's routing, measured on this machine only). The block's input
# gradient, on an AVX2 machine under ATEN_CPU_CAPABILITY=default: 0.12 of this budget
# (4.8e-6 absolute; DeepSeek-V3's groups, bias and scaling), so it gets twice the budget (0.06, 16x).
ATOL, RTOL = 1e-5, 1e-4
E, K, F_MOE = 4, 2, 48


def _cfg(layers: int, **moe) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=300,
                       num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F_MOE, ffn_hidden_size=F_MOE,
                       rotary_base=1e6, **moe)


@torch.no_grad()
def _mixtral_copy(ours: Decoder, aux_coef: float = 0.0) -> MixtralForCausalLM:
    cfg = ours.cfg
    theirs = MixtralForCausalLM(MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=F_MOE, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads, num_local_experts=E,
        num_experts_per_tok=K, rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, router_aux_loss_coef=aux_coef,
        output_router_logits=aux_coef > 0, max_position_embeddings=cfg.max_position_embeddings,
        attn_implementation="eager")).float().eval()
    params = dict(theirs.named_parameters())
    for name, p in ours.state_dict().items():
        if ".experts." not in name:
            target = params[hf_name(name, cfg).replace("block_sparse_moe.", "mlp.")]
            target.copy_(p[: cfg.vocab_size] if target.shape != p.shape else p)
    for i in range(cfg.num_layers):
        _fuse_experts(ours.layers[str(i)].mlp, params, f"model.layers.{i}.mlp.experts.")
    return theirs


def _fuse_experts(moe: MoE, params: dict, prefix: str) -> None:
    """transformers >= 5 holds experts fused: gate_up_proj (E, 2f, h) = [w1; w3], down_proj (E, h, f)."""
    for e, ex in moe.experts.items():
        params[prefix + "gate_up_proj"][int(e)].copy_(torch.cat([ex.gate_proj.weight, ex.up_proj.weight]))
        params[prefix + "down_proj"][int(e)].copy_(ex.down_proj.weight)


def _expert_grads(moe: MoE, params: dict, prefix: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for e, ex in moe.experts.items():
        gu = params[prefix + "gate_up_proj"].grad[int(e)]
        out[f"{e}.gate"] = (ex.gate_proj.weight.grad, gu[:F_MOE])
        out[f"{e}.up"] = (ex.up_proj.weight.grad, gu[F_MOE:])
        out[f"{e}.down"] = (ex.down_proj.weight.grad, params[prefix + "down_proj"].grad[int(e)])
    return out


def _batch(cfg: ModelConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)


def _min_margin(ours: Decoder, ids) -> float:
    """Smallest gap between the k-th and (k+1)-th router score over every token and MoE layer."""
    gaps = []
    hooks = [layer.mlp.router.register_forward_hook(
        lambda m, args, out: gaps.append(torch.softmax(F.linear(args[0], m.weight), -1).topk(K + 1).values.diff(dim=-1)[:, -1].abs().min()))
        for layer in ours.layers.values()]
    with torch.no_grad():
        ours(ids)
    for h in hooks:
        h.remove()
    return float(min(gaps))


def _compare_grads(ours: Decoder, theirs: MixtralForCausalLM, case: str) -> None:
    cfg, params = ours.cfg, dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if ".experts." in name:
            continue
        g_ref = params[hf_name(name, cfg).replace("block_sparse_moe.", "mlp.")].grad
        g = p.grad[: cfg.vocab_size] if p.shape != g_ref.shape else p.grad
        # Gradients ~1e-4..1e-1: absolute 1e-6 is >= 1e3 ulps of the smallest, relative as above.
        close(g, g_ref, rtol=RTOL, atol=1e-6, site="hf_mixtral.grads", case=f"{case} {name}")
    for i in range(cfg.num_layers):
        for what, (g, g_ref) in _expert_grads(ours.layers[str(i)].mlp, params, f"model.layers.{i}.mlp.experts.").items():
            close(g, g_ref, rtol=RTOL, atol=1e-6, site="hf_mixtral.expert_grads", case=f"{case} layer {i} expert {what}")


def test_mixtral_logits_loss_and_every_gradient_match_hf():
    cfg = _cfg(2)
    ours = Decoder(cfg, seed=3)
    theirs = _mixtral_copy(ours)
    ids, labels = _batch(cfg)
    assert _min_margin(ours, ids) > 1e-5
    out = theirs(input_ids=ids, labels=ids)
    total, count = ours.loss(ids, labels)
    close(ours(ids)[..., : cfg.vocab_size], out.logits, rtol=RTOL, atol=ATOL, site="hf_mixtral.logits")
    close(total / count, out.loss, rtol=RTOL, atol=ATOL, site="hf_mixtral.loss")
    (total / count).backward()
    out.loss.backward()
    _compare_grads(ours, theirs, "2 layers")


def test_mixtral_load_balancing_loss_gradient_matches_hf():
    coef = 0.5  # large, so that the aux term moves the router gradient well beyond the tolerance
    cfg = _cfg(1, moe_aux_loss_coeff=K * coef)
    ours = Decoder(cfg, seed=5)
    theirs = _mixtral_copy(ours, aux_coef=coef)
    ids, labels = _batch(cfg, seed=1)
    assert _min_margin(ours, ids) > 1e-5
    out = theirs(input_ids=ids, labels=ids)
    total, count = ours.loss(ids, labels)
    (total / count).backward()  # the reported loss is the LM loss: the aux term enters the gradient only
    close(total / count + coef * out.aux_loss, out.loss, rtol=RTOL, atol=ATOL, site="hf_mixtral.loss_with_aux")
    out.loss.backward()
    _compare_grads(ours, theirs, "aux loss")
    without = Decoder(_cfg(1), seed=5)
    t2, c2 = without.loss(ids, labels)
    (t2 / c2).backward()
    moved = (ours.layers["0"].mlp.router.weight.grad - without.layers["0"].mlp.router.weight.grad).abs().max()
    assert moved > 1e-3  # the aux gradient is really there (1e3 x the tolerance)


def _block_inputs(seed: int = 0):
    return torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _our_block(cfg: ModelConfig) -> MoE:
    block = MoE(cfg)
    with torch.no_grad():
        init_parameters_(block, seed=11, std=0.2, vocab_size=cfg.vocab_size)  # std 0.2: clear routing margins
    return block


def _check_block(ours: MoE, theirs: torch.nn.Module, hf_experts_prefix: str, extra: dict[str, str], case: str) -> None:
    x = _block_inputs()
    x2 = x.detach().clone().requires_grad_(True)
    y, y_ref = ours(x), theirs(x2)
    close(y, y_ref, rtol=RTOL, atol=ATOL, site="hf_moe_block.output", case=case)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    (y_ref * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    close(x.grad, x2.grad, rtol=2 * RTOL, atol=2 * ATOL, site="hf_moe_block.input_grad", case=case)
    params = dict(theirs.named_parameters())
    for ours_name, theirs_name in extra.items():
        close(dict(ours.named_parameters())[ours_name].grad, params[theirs_name].grad, rtol=RTOL, atol=1e-5,
              site="hf_moe_block.grads", case=f"{case} {ours_name}")
    for what, (g, g_ref) in _expert_grads(ours, params, hf_experts_prefix).items():
        close(g, g_ref, rtol=RTOL, atol=1e-5, site="hf_moe_block.expert_grads", case=f"{case} expert {what}")


def test_moe_block_without_renormalisation_matches_olmoe():
    cfg = _cfg(1, moe_router_pre_softmax=True)
    ours = _our_block(cfg)
    theirs = OlmoeSparseMoeBlock(OlmoeConfig(hidden_size=64, intermediate_size=F_MOE, num_experts=E,
                                             num_experts_per_tok=K, norm_topk_prob=False)).float()
    params = dict(theirs.named_parameters())
    with torch.no_grad():
        params["gate.weight"].copy_(ours.router.weight)
        _fuse_experts(ours, params, "experts.")
    _check_block(ours, theirs, "experts.", {"router.weight": "gate.weight"}, "olmoe")


@pytest.mark.parametrize("routing", ["plain", "groups-bias-scaled"])
def test_moe_block_sigmoid_with_shared_experts_matches_deepseek_v3(routing):
    """plain: one group, no bias, scaling 1; groups-bias-scaled: DeepSeek-V3's routing (2 groups of 2,
    the best one chosen by its top-2 sum, e_score_correction_bias = our expert bias, routed_scaling_factor
    2.5), the bias large enough to change which group tokens take."""
    grouped = routing != "plain"
    router = dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=2.5) if grouped else {}
    cfg = _cfg(1, moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=2 * F_MOE, **router)
    ours = _our_block(cfg)
    theirs = DeepseekV3MoE(DeepseekV3Config(hidden_size=64, moe_intermediate_size=F_MOE, intermediate_size=F_MOE,
                                            n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=2,
                                            n_group=2 if grouped else 1, topk_group=1, norm_topk_prob=True,
                                            routed_scaling_factor=2.5 if grouped else 1.0)).float()
    params = dict(theirs.named_parameters())
    with torch.no_grad():
        if grouped:
            ours.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.3]))
            theirs.gate.e_score_correction_bias.copy_(ours.router.expert_bias)
        params["gate.weight"].copy_(ours.router.weight)
        _fuse_experts(ours, params, "experts.")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            params[f"shared_experts.{proj}.weight"].copy_(getattr(ours.shared_experts, proj).weight)
    _check_block(ours, theirs, "experts.", {"router.weight": "gate.weight",
                                             **{f"shared_experts.{p}.weight": f"shared_experts.{p}.weight"
                                                for p in ("gate_proj", "up_proj", "down_proj")}}, f"deepseek-v3 {routing}")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_checkpoint_imports_with_hf_logits(norm_topk_prob, tmp_path):
    """A Qwen3-MoE folder written by transformers (per-expert tensors, q / k norms) loads into our
    decoder with HF's logits: norm_topk_prob renormalises the top-k (else moe_router_pre_softmax)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fivefold.hf.load import load_hf

    torch.manual_seed(0)
    theirs = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=F_MOE, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, attn_implementation="eager")).float().eval()
    with torch.no_grad():  # norms away from 1, so a gain read into the wrong place shows
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert (ours.cfg.qk_layernorm, ours.cfg.moe_router_pre_softmax) == (True, not norm_topk_prob)
    ids, _ = _batch(ours.cfg)
    assert _min_margin(ours, ids) > 1e-5
    with torch.no_grad():
        close(ours(ids)[..., :300], theirs(input_ids=ids).logits, rtol=RTOL, atol=ATOL, site="hf_mixtral.logits",
              case=f"qwen3_moe norm_topk_prob={norm_topk_prob}")
