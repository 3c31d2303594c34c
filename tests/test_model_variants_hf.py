"""Megatron's model variants against HF transformers with the same weights, fp32 on CPU:
GPT-2 (activation_function="gelu") is Megatron's default GPT: GeLU MLP, linear biases, LayerNorm,
learned absolute positions, tied embeddings; Llama with attention_bias/mlp_bias is SwiGLU with
--add-bias-linear. LayerNorm-1p has no HF model: it is checked against
our plain LayerNorm holding w = 1 + g."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.model import Decoder
from fivefold.hf.names import hf_name
from fivefold.model.init import VOCAB_PARAMS
from fivefold.planner.memory.params import count_params

# Same bounds as test_model_hf.py (fp32, different kernels and summation orders): measured worst
# logits 2.1e-7 abs (0.009 of the bound, >100x), grads 1.4e-8 abs (0.009 of 1e-6 + 1e-4 |g|), loss 0;
# a wrong bias, position row or GeLU variant (tanh vs erf) moves logits by > 1e-4.
ATOL, RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6

MEGATRON_GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300,
                           activation="gelu", add_bias_linear=True, position_embedding_type="learned_absolute",
                           normalization="LayerNorm", tie_word_embeddings=True, max_position_embeddings=32)


def _gpt2_names(cfg: ModelConfig) -> dict[str, tuple[str, callable]]:
    """Our name -> (GPT-2 name, ours -> theirs). Conv1D stores (in, out): ours transposed;
    c_attn is q, k, v concatenated along the output."""
    t = lambda w: w.t() if w.dim() == 2 else w  # noqa: E731
    out = {"embedding.weight": ("transformer.wte.weight", None), "position_embedding.weight": ("transformer.wpe.weight", None),
           "final_norm.weight": ("transformer.ln_f.weight", None), "final_norm.bias": ("transformer.ln_f.bias", None)}
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for k in ("weight", "bias"):
                out[f"{p}{ours}.{k}"] = (f"{q}{theirs}.{k}", None)
        for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            for k in ("weight", "bias"):
                out[f"{p}{ours}.{k}"] = (f"{q}{theirs}.{k}", t)
    return out


def _qkv_slice(cfg: ModelConfig, name: str):
    """GPT-2's fused c_attn holds q, k, v: the slice of it (transposed) that is our q/k/v_proj."""
    j = "qkv".index(name.split(".")[-2][0])
    h = cfg.hidden_size
    return lambda w: (w.t() if w.dim() == 2 else w)[j * h:(j + 1) * h]


def _theirs_of(ours: Decoder, theirs, names: dict) -> dict[str, torch.Tensor]:
    """Our name -> the HF tensor (or grad, via .grad on the returned leaves' sources) in our layout."""
    params = dict(theirs.named_parameters(remove_duplicate=False))
    got = {}
    for name in dict(ours.named_parameters()):
        if name in names:
            hf, f = names[name]
            got[name] = (params[hf], f)
        else:  # layers.i.attn.{q,k,v}_proj.{weight,bias}
            i = name.split(".")[1]
            kind = name.split(".")[-1]
            got[name] = (params[f"transformer.h.{i}.attn.c_attn.{kind}"], _qkv_slice(ours.cfg, name))
    return got


@torch.no_grad()
def _gpt2_copy_of(ours: Decoder) -> GPT2LMHeadModel:
    cfg = ours.cfg
    theirs = GPT2LMHeadModel(GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_epsilon,
        tie_word_embeddings=True, attn_implementation="eager")).float().eval()
    for name, p in ours.named_parameters():
        target, f = _theirs_of(ours, theirs, _gpt2_names(cfg))[name]
        value = p[: cfg.vocab_size] if name == "embedding.weight" else p
        view = f(target) if f else target
        view.copy_(value)  # views of the HF tensor: writes land in it
    return theirs


def _batch(cfg: ModelConfig, s: int = 24):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, s), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)


def _perturb(model: Decoder) -> None:
    """Biases and gains start at 0 / 1: move them so a missing or misplaced one shows."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _check(ours: Decoder, out, grads_theirs: dict, site: str) -> None:
    cfg = ours.cfg
    ids, labels = _batch(cfg)
    total, count = ours.loss(ids, labels)
    close(ours(ids)[..., : cfg.vocab_size], out.logits, rtol=RTOL, atol=ATOL, site=f"{site}.logits", case="")
    close(total / count, out.loss, rtol=RTOL, atol=ATOL, site=f"{site}.loss", case="")
    (total / count).backward()
    out.loss.backward()
    for name, p in ours.named_parameters():
        g = p.grad[: cfg.vocab_size] if name in VOCAB_PARAMS else p.grad
        close(g, grads_theirs(name), rtol=RTOL, atol=GRAD_ATOL, site=f"{site}.grads", case=name)


def test_megatron_default_gpt_matches_hf_gpt2():
    """GeLU MLP, linear biases, learned absolute positions, LayerNorm, tied embeddings."""
    ours = Decoder(MEGATRON_GPT, seed=5)
    _perturb(ours)
    theirs = _gpt2_copy_of(ours)
    ids, _ = _batch(MEGATRON_GPT)
    out = theirs(input_ids=ids, labels=ids)
    mapped = _theirs_of(ours, theirs, _gpt2_names(MEGATRON_GPT))

    def grad(name):
        target, f = mapped[name]
        g = f(target.grad) if f else target.grad
        return g[: MEGATRON_GPT.vocab_size] if name == "embedding.weight" else g
    _check(ours, out, grad, "hf_gpt2")


@torch.no_grad()
def _llama_like_copy_of(ours: Decoder, hf_cls, hf_cfg):
    theirs = hf_cls(hf_cfg).float().eval()
    params = dict(theirs.named_parameters(remove_duplicate=False))
    for name, p in ours.named_parameters():
        params[hf_name(name, ours.cfg)].copy_(p[: ours.cfg.vocab_size] if name in VOCAB_PARAMS else p)
    assert {n for n, _ in theirs.named_parameters()} == {hf_name(n, ours.cfg) for n, _ in ours.named_parameters()}
    return theirs


def _hf_kwargs(cfg: ModelConfig) -> dict:
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.kv_heads, rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base,
                tie_word_embeddings=False, max_position_embeddings=cfg.max_position_embeddings,
                attn_implementation="eager")


def test_swiglu_with_linear_biases_matches_hf_llama():
    """--swiglu with Megatron's linear biases = HF Llama with attention_bias and mlp_bias (--add-qkv-bias
    alone, Qwen2, is checked in test_model_hf.py)."""
    base = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=300)
    cfg = replace(base, add_bias_linear=True)
    hf_cls, hf_cfg = LlamaForCausalLM, LlamaConfig(**_hf_kwargs(base), attention_bias=True, mlp_bias=True)
    ours = Decoder(cfg, seed=5)
    _perturb(ours)
    theirs = _llama_like_copy_of(ours, hf_cls, hf_cfg)
    ids, _ = _batch(cfg)
    out = theirs(input_ids=ids, labels=ids)
    hf = dict(theirs.named_parameters())

    def grad(name):
        g = hf[hf_name(name, cfg)].grad
        return g[: cfg.vocab_size] if name in VOCAB_PARAMS else g
    _check(ours, out, grad, "hf_llama_bias")


def test_layernorm_1p_is_layernorm_with_one_plus_gain():
    """Stored gain g, used gain 1 + g: the same model as plain LayerNorm holding 1 + g (bit-exact),
    and a freshly built 1p model starts with g = 0, i.e. the plain model's ones."""
    cfg_1p = replace(MEGATRON_GPT, apply_layernorm_1p=True)
    one_p, plain = Decoder(cfg_1p, seed=5), Decoder(MEGATRON_GPT, seed=5)
    gains = [n for n in plain.state_dict() if n.endswith("norm.weight")]
    assert all(not one_p.state_dict()[n].any() for n in gains)
    assert all(torch.equal(plain.state_dict()[n], torch.ones_like(plain.state_dict()[n])) for n in gains)
    _perturb(one_p)
    state = one_p.state_dict()
    plain.load_state_dict({n: (v + 1 if n in gains else v) for n, v in state.items()})
    ids, labels = _batch(cfg_1p)
    assert torch.equal(one_p(ids), plain(ids))


MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
           v_head_dim=8)


@pytest.mark.parametrize("kw", [dict(), dict(add_bias_linear=True, num_query_groups=2),
                                dict(normalization="LayerNorm", qk_layernorm=True, add_bias_linear=True),
                                dict(qk_layernorm=True, qk_layernorm_scope="projection", num_query_groups=2),
                                dict(MLA, qk_layernorm=True), dict(MLA)],
                         ids=["megatron-gpt", "swiglu-biases-gqa", "layernorm-qk-norm", "projection-qk-norm",
                              "mla-latent-norms", "mla-no-latent-norms"])
def test_planner_counts_the_parameters_each_variant_builds(kw):
    """The planner's count (memory model, FLOPs) equals the built model's, biases, GeLU's two
    matrices, LayerNorm biases and the position table included."""
    base = replace(MEGATRON_GPT, vocab_size=256) if not kw else ModelConfig(hidden_size=64, num_attention_heads=4)
    cfg = replace(base, **kw)  # vocab 256: no padding rows, which the planner does not count
    built = sum(p.numel() for p in Decoder(cfg).parameters())
    assert built == count_params(cfg).total
