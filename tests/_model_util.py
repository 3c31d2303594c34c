"""Helpers for the model tests: our config -> an HF LlamaConfig, and weights copied between them."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.model import Decoder
from fivefold.hf.names import hf_name


def hf_config(cfg: ModelConfig) -> LlamaConfig:
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_epsilon,
                       rope_theta=cfg.rotary_base, tie_word_embeddings=cfg.tie_word_embeddings,
                       max_position_embeddings=cfg.max_position_embeddings, attn_implementation="eager")


@torch.no_grad()
def hf_copy_of(ours: Decoder) -> LlamaForCausalLM:
    """An HF LlamaForCausalLM holding exactly our weights (vocabulary rows unpadded)."""
    cfg = ours.cfg
    theirs = LlamaForCausalLM(hf_config(cfg)).float().eval()
    params = dict(theirs.named_parameters(remove_duplicate=False))
    copied = set()
    for name, p in ours.state_dict().items():
        target = params[hf_name(name, cfg)]
        target.copy_(p[: cfg.vocab_size] if target.shape != p.shape else p)
        copied.add(hf_name(name, cfg))
    missing = set(params) - copied - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert not missing, missing
    return theirs


def assert_grads_match_hf(ours: Decoder, theirs, *, atol: float, rtol: float, site: str) -> None:
    """Every parameter's gradient (vocabulary rows unpadded) equals the HF model's of the same weight;
    padded vocabulary rows are masked out of the loss, so their gradient is exactly zero."""
    hf_params = dict(theirs.named_parameters())
    for our_name, p in ours.named_parameters():
        g_ref = hf_params[hf_name(our_name, ours.cfg)].grad
        g = p.grad[: ours.cfg.vocab_size] if p.shape != g_ref.shape else p.grad
        close(g, g_ref, rtol=rtol, atol=atol, site=site, case=our_name)
        if p.shape[0] != g_ref.shape[0]:
            assert not p.grad[ours.cfg.vocab_size:].any(), our_name
