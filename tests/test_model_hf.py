"""Our Decoder against HF transformers' LlamaForCausalLM with the same weights, in fp32 on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.model import Decoder
from tests._model_util import assert_grads_match_hf, hf_copy_of

CONFIGS = {
    "mha-untied": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300),
    "gqa-tied": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            vocab_size=256, tie_word_embeddings=True),
    "gqa-headdim24": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                                 kv_channels=24, ffn_hidden_size=96, vocab_size=270, rotary_base=5000.0,
                                 norm_epsilon=1e-6),
    "mqa-tied-headdim32": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=1,
                                      kv_channels=32, vocab_size=290, tie_word_embeddings=True),
}

# Tolerances: both sides are fp32 and do the same math, but with different kernels (SDPA with
# enable_gqa vs HF's eager matmul-softmax with repeat_kv) and summation orders, so results differ
# by a few fp32 ulps per op. Measured worst over the CPU kernel settings (docs/tolerances.md): logits
# 4.8e-7 abs (0.014 of the bound, 70x), gradients 7.5e-8 abs (0.035 of 1e-6 + 1e-4 * |g|, 28x), the
# loss 0 or 4.8e-7. 1e-5 absolute / 1e-4 relative is kept for other BLAS builds (this machine's MKL
# takes one path under every setting) and still catches any real error (a wrong RoPE half, GQA
# grouping or norm eps moves logits by >1e-3).
ATOL, RTOL = 1e-5, 1e-4


def _batch(cfg: ModelConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # next token; last has none
    return ids, labels


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_loss_and_every_gradient_match_hf(name):
    cfg = CONFIGS[name]
    ours = Decoder(cfg, seed=7)
    theirs = hf_copy_of(ours)
    ids, labels = _batch(cfg)

    out = theirs(input_ids=ids, labels=ids)  # HF shifts labels itself and returns the token mean
    total, count = ours.loss(ids, labels)
    assert count.item() == 2 * 23
    close(ours(ids)[..., : cfg.vocab_size], out.logits, rtol=RTOL, atol=ATOL, site="hf_llama.logits", case=name)
    # Loss is a mean of 46 cross-entropies ~ln(V) ~ 5.6: same fp32 noise as the logits.
    close(total / count, out.loss, rtol=RTOL, atol=ATOL, site="hf_llama.loss", case=name)

    (total / count).backward()
    out.loss.backward()
    # Gradients are ~1e-3..1e-1; absolute 1e-6 is ~1e3 ulps of the smallest, relative 1e-4 as above.
    assert_grads_match_hf(ours, theirs, atol=1e-6, rtol=RTOL, site="hf_llama.grads")


def test_logprobs_match_hf_log_softmax():
    cfg = CONFIGS["mha-untied"]
    ours = Decoder(cfg, seed=1)
    ids, labels = _batch(cfg, seed=3)
    with torch.no_grad():
        ref = F.log_softmax(hf_copy_of(ours)(input_ids=ids).logits, -1)[:, :-1].gather(-1, labels[:, :-1, None])[..., 0]
        got = ours.logprobs(ids, labels)
    close(got[:, :-1], ref, rtol=RTOL, atol=ATOL, site="hf_llama.logprobs")  # same fp32 noise as the logits
    assert torch.equal(got[:, -1], torch.zeros(2))  # ignored label -> exactly 0
    # Padded vocab columns carry no probability: log-probs over the real vocabulary sum to 1.
    with torch.no_grad():
        total, count = ours.loss(ids, labels)
    close(-got.sum(), total, rtol=1e-5, atol=1e-4, site="hf_llama.logprob_sum")  # sum of 46 terms ~5.6 each


QWEN = {  # our config -> the HF class it must equal, with its extra attention parameters
    "qwen2-qkv-bias": (ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   vocab_size=256, add_qkv_bias=True), "Qwen2"),
    "qwen3-qk-norm": (ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                  kv_channels=32, vocab_size=256, qk_layernorm=True, tie_word_embeddings=True), "Qwen3"),
}


@pytest.mark.parametrize("name", QWEN)
def test_qwen_attention_variants_match_hf(name):
    """QKV biases (Qwen2) and per-head q / k RMSNorm (Qwen3) against transformers' own classes; biases
    and gains set away from their zero / one init so that a missing term shows."""
    import transformers

    from fivefold.hf.names import hf_name
    cfg, family = QWEN[name]
    ours = Decoder(cfg, seed=7)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith(".bias") or "q_norm" in n or "k_norm" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    hf_cfg = getattr(transformers, f"{family}Config")(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base,
        tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_position_embeddings,
        use_sliding_window=False, attn_implementation="eager")
    theirs = getattr(transformers, f"{family}ForCausalLM")(hf_cfg).float().eval()
    params = dict(theirs.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for n, p in ours.state_dict().items():
            target = params[hf_name(n, cfg)]
            target.copy_(p[: cfg.vocab_size] if target.shape != p.shape else p)
    ids, labels = _batch(cfg)
    out = theirs(input_ids=ids, labels=ids)
    total, count = ours.loss(ids, labels)
    # the Llama bounds above (same kernels; measured in docs/tolerances.md under hf_qwen.*)
    close(ours(ids)[..., : cfg.vocab_size], out.logits, rtol=RTOL, atol=ATOL, site="hf_qwen.logits", case=name)
    (total / count).backward()
    out.loss.backward()
    assert_grads_match_hf(ours, theirs, atol=1e-6, rtol=RTOL, site="hf_qwen.grads")
