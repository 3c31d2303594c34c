"""Model math against HF transformers, fp32 on CPU, same weights:
  MLA:       our Decoder with multi_latent_attention vs DeepseekV3ForCausalLM with every layer dense
             (first_k_dense_replace = num_hidden_layers, so no MoE is built) and plain RoPE, with
             uncompressed (q_lora_rank None) and compressed queries; and a DeepseekV3 checkpoint
             written by save_pretrained read back by load_hf.
  LayerNorm: our Decoder with normalization=LayerNorm vs HF LlamaForCausalLM whose RMSNorm modules
             are replaced by torch.nn.LayerNorm: Llama's layer is exactly our pre-norm layer (checked
             against it with RMSNorm in test_model_hf.py), and torch's LayerNorm is an implementation
             independent of ours (ours is F.layer_norm in fp32; nn.LayerNorm is the module users know).
Norm gains and biases are perturbed away from their ones / zeros initialisation first, so a gain or
bias that were wired wrongly (or ignored) changes the result.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaForCausalLM

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError
from fivefold.model import Decoder
from fivefold.config.hf import config_from_hf
from fivefold.hf.load import load_hf
from fivefold.hf.names import hf_name
from tests._model_util import assert_grads_match_hf, hf_config

MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300, ffn_hidden_size=96,
           multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
           norm_epsilon=1e-6, rotary_base=5000.0)
"""norm_epsilon 1e-6: HF's latent norms (q_a_layernorm, kv_a_layernorm) always use 1e-6."""
CONFIGS = {"mla-q-uncompressed": ModelConfig(**MLA, q_lora_rank=None),
           "mla-q-lora48": ModelConfig(**MLA, q_lora_rank=48),
           "layernorm-gqa": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                        vocab_size=300, normalization="LayerNorm", norm_epsilon=1e-5)}

# Tolerances as tests/test_model_hf.py: both sides fp32 with the same math through different kernels
# (SDPA vs HF eager attention, F.layer_norm vs nn.LayerNorm, different concatenation / split orders),
# so a few fp32 ulps per op; over 2 layers < 1e-6 (measured below). A wrong RoPE pair layout, a
# swapped k_nope / v split or a missing bias moves logits by > 1e-3. Measured worst over the CPU kernel
# settings (docs/tolerances.md): logits 2.1e-7 abs (0.011 of the bound), gradients 6.5e-8 abs (0.057,
# 18x) on all three; half-split instead of interleaved RoPE pairs: logits 4.7e-3.
ATOL, RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6


def deepseek_config(cfg: ModelConfig) -> DeepseekV3Config:
    """An all-dense DeepseekV3 with our shapes and plain RoPE (rope_interleave: DeepSeek's default)."""
    return DeepseekV3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                            num_hidden_layers=cfg.num_layers, first_k_dense_replace=cfg.num_layers,
                            num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
                            q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
                            qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                            rms_norm_eps=cfg.norm_epsilon, rope_interleave=True, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
                            max_position_embeddings=cfg.max_position_embeddings, attn_implementation="eager")


def layernorm_llama(cfg: ModelConfig) -> LlamaForCausalLM:
    model = LlamaForCausalLM(hf_config(cfg))
    for layer in model.model.layers:
        layer.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
        layer.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    model.model.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    return model


@torch.no_grad()
def reference(ours: Decoder) -> nn.Module:
    """The HF model of `ours`' kind holding exactly its weights (vocabulary rows unpadded)."""
    cfg = ours.cfg
    theirs = (DeepseekV3ForCausalLM(deepseek_config(cfg)) if cfg.multi_latent_attention else layernorm_llama(cfg))
    theirs = theirs.float().eval()
    params = dict(theirs.named_parameters())
    copied = set()
    for name, p in ours.state_dict().items():
        target = params[hf_name(name, cfg)]
        target.copy_(p[: cfg.vocab_size] if target.shape != p.shape else p)
        copied.add(hf_name(name, cfg))
    assert copied == set(params), set(params) ^ copied  # every HF weight comes from ours, and no extra
    return theirs


@torch.no_grad()
def perturb_norms(model: Decoder) -> None:
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def _batch(cfg: ModelConfig):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_loss_and_every_gradient_match_hf(name):
    cfg = CONFIGS[name]
    ours = Decoder(cfg, seed=3)
    perturb_norms(ours)
    theirs = reference(ours)
    ids, labels = _batch(cfg)
    out = theirs(input_ids=ids, labels=ids)  # HF shifts the labels and returns the token mean
    total, count = ours.loss(ids, labels)
    close(ours(ids)[..., : cfg.vocab_size], out.logits, rtol=RTOL, atol=ATOL, site="hf_mla.logits", case=name)
    close(total / count, out.loss, rtol=RTOL, atol=ATOL, site="hf_mla.loss", case=name)  # mean of 46 CEs ~ ln V
    (total / count).backward()
    out.loss.backward()
    # gradients ~1e-4..1e-1: absolute 1e-6 is far below any real error, relative as the logits
    assert_grads_match_hf(ours, theirs, atol=GRAD_ATOL, rtol=RTOL, site="hf_mla.grads")


def test_deepseek_checkpoint_loads_and_matches_hf(tmp_path):
    cfg = CONFIGS["mla-q-lora48"]
    torch.manual_seed(0)
    theirs = DeepseekV3ForCausalLM(deepseek_config(cfg)).float().eval()  # HF's own random weights
    theirs.save_pretrained(tmp_path)
    # the same model read back (the planner also records kv_channels = dn + dr; the unused expert
    # keys of an all-dense DeepSeek config are dropped)
    assert config_from_hf(tmp_path) == replace(cfg, kv_channels=24, init_method_std=theirs.config.initializer_range)
    ours = load_hf(tmp_path)
    ids, _ = _batch(cfg)
    with torch.no_grad():
        close(ours(ids)[..., : cfg.vocab_size], theirs(input_ids=ids).logits, rtol=RTOL, atol=ATOL,
              site="hf_mla.deepseek_checkpoint_logits")


@pytest.mark.parametrize("change,message", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}), "rope_type='yarn'"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05"),
])
def test_deepseek_config_we_cannot_compute_is_refused_naming_the_key(tmp_path, change, message):
    import json

    hf = deepseek_config(CONFIGS["mla-q-lora48"]).to_dict()
    hf.update(change)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UserError, match=message):
        config_from_hf(tmp_path)
