"""DeepSeek-V3 checkpoints with MoE layers (model_type deepseek_v3; Moonlight; kimi_k2) against HF
transformers' DeepseekV3ForCausalLM, fp32 on CPU, random small configs written by save_pretrained:

- import: our logits, loss and every gradient equal HF's on 3 layers, the first dense
  (first_k_dense_replace=1), MLA with compressed queries, sigmoid routing with a nonzero
  e_score_correction_bias that changes the choice, shared experts, and either group-limited routing
  (n_group 4, topk_group 2, top-4 of 16: a group scores its top 2) with norm_topk_prob and
  routed_scaling_factor 2.5, or one group (Moonlight, Kimi-K2) without renormalisation;
- export: import -> `fivefold export` gives HF's tensors back bit for bit (the fp32 bias included) and
  a config.json from which transformers builds the same model (its logits equal the original's);
- multi-token prediction: the MTP module stored as model.layers.<num_hidden_layers>.* imports
  (num_nextn_predict_layers -> mtp_num_layers) and its loss and gradients equal DeepSeek-V3's formula on
  transformers' modules (transformers itself does not run MTP), export writes it back bit for bit, copies
  of the embedding / output layer that differ are refused, layers past the declared ones are skipped
  with a note; kimi_k2 reads as deepseek_v3; routing HF computes otherwise than we do is refused naming the key.
"""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError
from fivefold.model import Decoder
from fivefold.config.hf import config_from_hf
from fivefold.hf.load import load_hf
from fivefold.hf.names import hf_name

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6, rope_interleave=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=False,
            max_position_embeddings=64, attn_implementation="eager")
CASES = {
    "groups": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                   routed_scaling_factor=2.5, n_shared_experts=1),
    "one-group": dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=False,
                      routed_scaling_factor=1.8, n_shared_experts=2),
}
# Same budget as tests/test_model_hf_mla.py and test_model_hf_moe.py: fp32 on both sides, the same math
# through different kernels and summation orders (a few ulps per op); routing is a discrete choice whose
# margins are checked to be >> fp32 noise below, so both sides route every token identically. Measured
# worst over the CPU kernel settings (docs/tolerances.md): logits 2.2e-7 abs (0.014 of the bound), loss
# equal, gradients 6.7e-8 abs (0.046 of the bound, 22x; gradients ~1e-4..1e-1). With the bias left out
# of the choice the logits move by 0.08 (groups) and 0.11 (one group).
ATOL, RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (folder written by save_pretrained, the HF model it holds)."""
    out = {}
    for case, routing in CASES.items():
        torch.manual_seed(0)
        theirs = DeepseekV3ForCausalLM(DeepseekV3Config(**BASE, **routing)).float().eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in theirs.named_parameters():
                if "norm" in name:  # gains away from 1: one read into the wrong place shows
                    p.uniform_(0.5, 1.5, generator=g)
                elif name.endswith("mlp.gate.weight"):  # clear routing margins (HF's init: std 0.02)
                    p.normal_(0, 0.5, generator=g)
            for layer in theirs.model.layers[BASE["first_k_dense_replace"]:]:
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.15, 0.15, generator=g)
        folder = tmp_path_factory.mktemp(case)
        theirs.save_pretrained(folder)
        out[case] = folder, theirs
    return out


def _batch(seed: int = 0):
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(seed))
    return ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)


def _routing_margins(ours: Decoder, ids) -> tuple[float, int]:
    """(smallest gap over tokens and MoE layers between the last chosen and the first unchosen group
    score and expert choice score, tokens whose experts the bias changed)."""
    gaps, moved = [], 0

    def hook(router, args, _):
        nonlocal moved
        cfg, x = router.cfg, args[0]
        scores = torch.sigmoid(F.linear(x.float(), router.weight.float()))  # (n, E)
        choices = []
        for choice in (scores + router.expert_bias, scores):
            if cfg.moe_router_num_groups:  # HF's group score: the sum of its top 2
                per_group = choice.view(len(x), cfg.moe_router_num_groups, -1)
                group = per_group.topk(2, -1).values.sum(-1).sort(-1, descending=True).values  # (n, G)
                gaps.append((group[:, cfg.moe_router_group_topk - 1] - group[:, cfg.moe_router_group_topk]).min())
                best = per_group.topk(2, -1).values.sum(-1).topk(cfg.moe_router_group_topk, -1).indices
                allowed = torch.zeros(per_group.shape[:2], dtype=torch.bool).scatter_(1, best, True)
                choice = per_group.masked_fill(~allowed.unsqueeze(-1), -1e9).view(len(x), -1)
            top = choice.topk(cfg.moe_router_topk + 1, -1).values
            gaps.append((top[:, -2] - top[:, -1]).min())
            choices.append(choice.topk(cfg.moe_router_topk, -1).indices.sort(-1).values)
        moved += int((choices[0] != choices[1]).any(-1).sum())

    hooks = [layer.mlp.router.register_forward_hook(hook) for layer in ours.layers.values()
             if hasattr(layer.mlp, "router")]
    with torch.no_grad():
        ours(ids)
    for h in hooks:
        h.remove()
    return float(min(gaps)), moved


def _grad_of(theirs, name: str, cfg: ModelConfig) -> torch.Tensor:
    """HF's gradient of our parameter `name` (transformers >= 5 holds the experts fused in memory:
    gate_up_proj (E, 2f, h) = [gate; up], down_proj (E, h, f))."""
    parts = name.split(".")
    params = dict(theirs.named_parameters())
    if parts[2:4] == ["mlp", "experts"]:
        prefix, e, f = f"model.layers.{parts[1]}.mlp.experts.", int(parts[4]), cfg.moe_ffn_hidden_size
        if parts[5] == "down_proj":
            return params[prefix + "down_proj"].grad[e]
        gate_up = params[prefix + "gate_up_proj"].grad[e]
        return gate_up[:f] if parts[5] == "gate_proj" else gate_up[f:]
    return params[hf_name(name, cfg)].grad


@pytest.mark.parametrize("case", CASES)
def test_logits_loss_and_every_gradient_match_hf(saved, case):
    folder, theirs = saved[case]
    ours = load_hf(folder)
    cfg = ours.cfg
    assert cfg.moe_first_k_dense_layers == 1
    assert (cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert sorted(ours.layers["1"].mlp.experts) == sorted(map(str, range(cfg.num_experts)))
    ids, labels = _batch()
    margin, moved = _routing_margins(ours, ids)
    assert margin > 1e-5, margin  # >= 100 x the fp32 noise of scores ~0.5 (~6e-8): both sides choose alike
    assert moved > 0  # the e_score_correction_bias changes some tokens' experts: it is really applied
    for p in theirs.parameters():
        p.grad = None
    out = theirs(input_ids=ids, labels=ids)  # HF shifts the labels and returns the token mean
    total, count = ours.loss(ids, labels)
    close(ours(ids)[..., : cfg.vocab_size], out.logits, rtol=RTOL, atol=ATOL, site="hf_deepseek.logits", case=case)
    close(total / count, out.loss, rtol=RTOL, atol=ATOL, site="hf_deepseek.loss", case=case)
    (total / count).backward()
    out.loss.backward()
    for name, p in ours.named_parameters():
        g_ref = _grad_of(theirs, name, cfg)
        g = p.grad[: cfg.vocab_size] if p.shape != g_ref.shape else p.grad
        close(g, g_ref, rtol=RTOL, atol=GRAD_ATOL, site="hf_deepseek.grads", case=f"{case} {name}")


def test_import_then_export_is_bit_identical_and_loads_in_transformers(saved, tmp_path):
    from fivefold.checkpoint.io import save_checkpoint
    from fivefold.cli import main
    from fivefold.config.schema import Config, to_dict

    folder, theirs = saved["groups"]
    ours = load_hf(folder)
    save_checkpoint(tmp_path / "ckpt", 0, model=ours, optimizer=torch.optim.AdamW(ours.parameters()), rank=0,
                    writes_params=True, barrier=lambda: None, extra={"config": to_dict(Config(model=ours.cfg))})
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    want, got = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert got["model.layers.2.mlp.gate.e_score_correction_bias"].abs().min() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").float().eval()
    for key in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
                "n_shared_experts", "moe_intermediate_size", "intermediate_size", "n_routed_experts",
                "num_experts_per_tok"):
        assert getattr(back.config, key) == getattr(theirs.config, key), key
    ids, _ = _batch(1)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, theirs(input_ids=ids).logits)  # the same model and kernels


def test_read_hf_shards_fills_parameters_and_the_expert_bias_as_load_hf(saved):
    """The --load-hf reader (per rank, by slices) gives the tensors load_hf gives, the fp32 bias included."""
    from fivefold.hf.load import read_hf_shards

    folder, _ = saved["groups"]
    want = load_hf(folder).state_dict()
    model = Decoder(config_from_hf(folder), seed=9)
    read_hf_shards(model, folder, model.cfg)
    got = model.state_dict()
    assert got.keys() == want.keys() and "layers.1.mlp.router.expert_bias" in got
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def _with_mtp_layer(src, dst, cfg: ModelConfig):
    """`src` plus DeepSeek-V3's MTP module as its checkpoints store it: layer num_hidden_layers, in a
    second shard behind an index."""
    shutil.copytree(src, dst)
    h, v, i = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    mtp = {f"model.layers.{i}.{name}": torch.ones(shape) for name, shape in (
        ("embed_tokens.weight", (v, h)), ("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
        ("shared_head.norm.weight", (h,)), ("shared_head.head.weight", (v, h)), ("input_layernorm.weight", (h,)),
        ("mlp.gate.weight", (cfg.num_experts, h)))}
    save_file(mtp, str(dst / "mtp.safetensors"), metadata={"format": "pt"})
    main = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").rename(dst / "model-main.safetensors")
    weight_map = {**{n: "model-main.safetensors" for n in main}, **{n: "mtp.safetensors" for n in mtp}}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _set_config(folder, **keys):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))


def test_layers_past_the_declared_mtp_ones_are_skipped_with_a_note(saved, tmp_path, capsys):
    """A folder whose config declares no MTP layers (num_nextn_predict_layers 0) but holds one: the main
    model loads without it, with a note; one that declares an MTP layer but holds none (the saved folders:
    transformers' default declares 1) imports without MTP and without a note."""
    from fivefold.config.load import load_config

    folder, theirs = saved["one-group"]
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert config_from_hf(folder).mtp_num_layers is None
    cfg = config_from_hf(folder)
    _with_mtp_layer(folder, tmp_path / "mtp", cfg)
    _set_config(tmp_path / "mtp", num_nextn_predict_layers=0)
    ours = load_hf(tmp_path / "mtp")
    assert "skipping 1 layer(s) past num_hidden_layers=3 and the 0 multi-token prediction layer(s) config.json " \
           "declares (num_nextn_predict_layers) (model.layers.3.*)" in capsys.readouterr().out
    ids, _ = _batch()
    with torch.no_grad():
        assert torch.equal(ours(ids), load_hf(folder)(ids))  # the same tensors read, MTP's ignored
    loaded = load_config(None, ["--load-hf", str(tmp_path / "mtp"), "--seq-length", "16", "--train-iters", "1"])
    assert any("num_nextn_predict_layers" in str(w) for w in loaded.warnings)


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """DeepSeek-V3 with one MTP module as its checkpoints store it: HF's model of 4 layers (groups case)
    saved, then config.json's num_hidden_layers 3 + num_nextn_predict_layers 1, so layer 3 (a MoE layer
    with its expert bias) is the MTP module's decoder layer, plus its enorm, hnorm, eh_proj,
    shared_head.norm and the copies of the embedding and output layer."""
    torch.manual_seed(0)
    theirs = DeepseekV3ForCausalLM(DeepseekV3Config(**{**BASE, "num_hidden_layers": 4}, **CASES["groups"]))
    theirs = theirs.float().eval()
    g = torch.Generator().manual_seed(2)
    h = BASE["hidden_size"]
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=g)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=g)
        for layer in theirs.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.15, 0.15, generator=g)
    folder = tmp_path_factory.mktemp("dsv3-mtp")
    theirs.save_pretrained(folder)
    extra = {"enorm.weight": torch.empty(h).uniform_(0.5, 1.5, generator=g),
             "hnorm.weight": torch.empty(h).uniform_(0.5, 1.5, generator=g),
             "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
             "shared_head.norm.weight": torch.empty(h).uniform_(0.5, 1.5, generator=g),
             "embed_tokens.weight": theirs.model.embed_tokens.weight.detach().clone(),
             "shared_head.head.weight": theirs.lm_head.weight.detach().clone()}
    tensors = {**load_file(str(folder / "model.safetensors")), **{f"model.layers.3.{k}": v for k, v in extra.items()}}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _set_config(folder, num_hidden_layers=3, num_nextn_predict_layers=1)
    return folder, theirs, extra


def _hf_mtp_sum(theirs, extra: dict[str, torch.nn.Parameter], ids, labels) -> torch.Tensor:
    """DeepSeek-V3's MTP depth 1 written out with transformers' modules: h0 = the last main layer's output
    (before the final norm), then [enorm(Emb(ids rolled 1)); hnorm(h0)] -> eh_proj -> HF's decoder layer 3
    -> shared_head.norm -> shared_head.head; summed CE against the labels rolled 1 (the last position has
    none). Embedding first in the concat: the order vLLM / SGLang use to run DeepSeek-V3's checkpoints."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    def norm(weight: torch.nn.Parameter):
        n = DeepseekV3RMSNorm(weight.shape[0], eps=BASE["rms_norm_eps"])
        n.weight = weight  # the caller's parameter: its gradient lands there
        return n

    m, s = theirs.model, ids.shape[1]
    pos = torch.arange(s)[None]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]  # causal, additive
    x = m.embed_tokens(ids)
    rope = m.rotary_emb(x, pos)
    for layer in m.layers[:3]:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    y = F.linear(torch.cat([norm(extra["enorm.weight"])(m.embed_tokens(nxt)), norm(extra["hnorm.weight"])(x)], -1),
                 extra["eh_proj.weight"])
    y = m.layers[3](y, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    logits = F.linear(norm(extra["shared_head.norm.weight"])(y), extra["shared_head.head.weight"])
    target = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")


def test_mtp_layer_imports_and_matches_the_formula_on_hf_modules(with_mtp):
    """num_nextn_predict_layers -> mtp_num_layers; the MTP depth's token-loss sum equals DeepSeek-V3's
    formula computed with transformers' layer 3 and norms, and the MTP module's own weights (enorm,
    hnorm, eh_proj, shared_head.norm) get that formula's gradient."""
    folder, theirs, extra = with_mtp
    ours = load_hf(folder)
    assert ours.cfg.mtp_num_layers == 1 and sorted(ours.mtp[0].layer.mlp.experts) == sorted(map(str, range(16)))
    ids, labels = _batch()
    total, _ = ours.loss(ids, labels)
    total.backward()
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in extra.items()}
    want = _hf_mtp_sum(theirs, ref, ids, labels)
    want.backward()
    # The same fp32 math through other kernels: the sums measured equal (0: layer 3 routes every token
    # alike); bound RTOL. Gradients: measured worst 4.8e-7 of the gradient's largest element
    # (eh_proj); bound 1e-5 of it (20x). A swapped concat or an unnormed input moves them by O(1).
    close(ours.mtp_loss_sums.float()[0], want.detach(), rtol=RTOL, site="hf_deepseek.mtp_sum")
    for ours_name, theirs_name in (("enorm", "enorm.weight"), ("hnorm", "hnorm.weight"), ("eh_proj", "eh_proj.weight"),
                                   ("final_norm", "shared_head.norm.weight")):
        grad, want_grad = getattr(ours.mtp[0], ours_name).weight.grad, ref[theirs_name].grad
        close(grad / ours.cfg.mtp_loss_scaling_factor, want_grad, rtol=0, atol=1e-5 * float(want_grad.abs().max()),
              site="hf_deepseek.mtp_grads", case=ours_name)


def test_mtp_export_is_bit_identical_and_copies_must_equal_the_main_ones(with_mtp, tmp_path):
    """import -> checkpoint -> export writes every tensor of the folder back bit for bit, the MTP module's
    copies of the embedding and output layer included; the per-rank reader (--load-hf) fills the MTP
    parameters as load_hf does; a copy that differs from the main tensor is refused by both readers."""
    from fivefold.checkpoint.io import save_checkpoint
    from fivefold.cli import main
    from fivefold.config.schema import Config, to_dict
    from fivefold.hf.load import read_hf_shards

    folder, _, _ = with_mtp
    ours = load_hf(folder)
    save_checkpoint(tmp_path / "ckpt", 0, model=ours, optimizer=torch.optim.AdamW(ours.parameters()), rank=0,
                    writes_params=True, barrier=lambda: None, extra={"config": to_dict(Config(model=ours.cfg))})
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    want, got = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want) and "model.layers.3.shared_head.head.weight" in got
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = Decoder(config_from_hf(folder), seed=9)
    read_hf_shards(model, folder, model.cfg)
    assert any(n.startswith("mtp.0.layer.mlp.experts.") for n in model.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    shutil.copytree(folder, tmp_path / "differs")
    want["model.layers.3.embed_tokens.weight"][0, 0] += 1
    save_file(want, str(tmp_path / "differs" / "model.safetensors"), metadata={"format": "pt"})
    for read in (lambda: load_hf(tmp_path / "differs"), lambda: read_hf_shards(model, tmp_path / "differs", model.cfg)):
        with pytest.raises(UserError, match="model.layers.3.embed_tokens.weight differs from the main model's "
                                            "model.embed_tokens.weight.*num_nextn_predict_layers to 0"):
            read()


def test_kimi_k2_reads_as_deepseek_v3(saved, tmp_path):
    folder, _ = saved["one-group"]
    shutil.copytree(folder, tmp_path / "kimi")
    raw = json.loads((folder / "config.json").read_text())
    kimi = {**raw, "model_type": "kimi_k2", "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(kimi))
    cfg = config_from_hf(tmp_path / "kimi")
    assert cfg == config_from_hf(folder)
    assert cfg.moe_router_num_groups is None  # n_group 1: no group limit
    assert (cfg.moe_router_pre_softmax, cfg.moe_router_topk_scaling_factor) == (True, 1.8)


@pytest.mark.parametrize("change,message", [
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
    (dict(topk_group=1), "num_experts_per_tok // topk_group = 2"),
    (dict(num_experts_per_tok=1, n_group=1), "num_experts_per_tok=1 with norm_topk_prob=true"),
    (dict(moe_layer_freq=2), "decoder_sparse_step=2"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "quant_method='fp8'"),
])
def test_routing_hf_computes_otherwise_is_refused_naming_the_key(tmp_path, change, message):
    hf = DeepseekV3Config(**BASE, **CASES["groups"]).to_dict()
    hf.update(change)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UserError, match=message):
        config_from_hf(tmp_path)


def test_load_hf_into_tp2sp_ep2_equals_one_process(saved, tmp_path, workers):
    """--load-hf of the group-limited checkpoint into TP2 + SP x EP2 (ETP1; each rank reads its
    slices, every rank the whole expert bias): the losses of 2 steps (the second routes with the
    bias moved by the first) equal the one-process run's from the same folder. Not 3: routing is a
    discrete choice, and by step 3 weights that differ by ulps flipped a token's experts under one
    CPU kernel setting (9.9e-6 relative, docs/tolerances.md)."""
    import test_zero
    from _train_util import corpus, losses, train_one_process
    from fivefold.config.load import load_config
    from fivefold.config.schema import to_dict

    folder, _ = saved["groups"]
    data = corpus(tmp_path / "corpus")
    words = ["--load-hf", str(folder), "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
             "--train-iters", "2", "--lr", "1e-3", f"data.path={data}"]
    cfg = load_config(None, words).config
    ref, data_dir = train_one_process(cfg, tmp_path)
    cfg.cluster.world_size = 4
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.expert_model_parallel_size = 2
    cfg.parallel.expert_tensor_parallel_size, cfg.parallel.sequence_parallel = 1, True
    workers(4).run(test_zero._train_rank, to_dict(cfg), str(tmp_path / "tp2ep2"), str(data_dir))
    # TP / SP / EP reorder fp32 sums: measured 6.5e-8 relative over the CPU kernel settings; bound 1e-5 (154x)
    close(losses(tmp_path / "tp2ep2"), [ref.losses[s] for s in sorted(ref.losses)], rtol=1e-5,
          site="hf_deepseek.load_hf_tp2ep2")


def test_load_hf_keeps_the_runs_moe_training_knobs(saved):
    """config.json decides the architecture; how the run trains the MoE (bias update rate, aux loss,
    capacity) stays the command line's, without a 'replaced' warning."""
    from fivefold.config.load import load_config

    folder, _ = saved["groups"]
    loaded = load_config(None, ["--load-hf", str(folder), "--moe-router-bias-update-rate", "0", "--moe-aux-loss-coeff",
                                "0.01", "--moe-expert-capacity-factor", "1.5", "--num-experts", "8"])
    m = loaded.config.model
    assert (m.moe_router_bias_update_rate, m.moe_aux_loss_coeff, m.moe_expert_capacity_factor) == (0.0, 0.01, 1.5)
    assert m.num_experts == 16 and m.moe_router_enable_expert_bias  # the checkpoint's
    assert [str(w) for w in loaded.warnings if "replaced" in str(w)] == [
        "warning: model.num_experts=8: checkpoint.load_hf's config.json says 16; this value is replaced (fix: drop it)"]


@pytest.mark.parametrize("change,message", [
    (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
     "moe_router_score_function='sigmoid'"),
    (dict(moe_router_enable_expert_bias=False), "moe_router_enable_expert_bias"),
    (dict(moe_shared_expert_intermediate_size=None), "shared experts a multiple of moe_ffn_hidden_size=32"),
    (dict(moe_router_topk=6, moe_router_group_topk=2), r"moe_router_topk // moe_router_group_topk = 2"),
])
def test_export_of_an_mla_moe_hf_cannot_compute_is_refused(saved, change, message):
    from dataclasses import replace

    from fivefold.errors import NotImplementedYet
    from fivefold.hf.config import hf_config

    cfg = config_from_hf(saved["groups"][0])
    assert hf_config(cfg, torch.float32)["n_group"] == 4
    with pytest.raises(NotImplementedYet, match=message):
        hf_config(replace(cfg, **change), torch.float32)


def test_planner_reads_deepseek_v3s_published_router():
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's config.json: 256 experts, top-8 within
    4 of 8 groups, routed_scaling_factor 2.5, renormalised, shared expert 2048 wide, 3 dense layers."""
    from fivefold.config.hf import model_from_hf_dict

    m = model_from_hf_dict({**DeepseekV3Config().to_dict(), "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    assert (m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk) == (256, 8, 8, 4)
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (m.moe_router_pre_softmax, m.moe_router_topk_scaling_factor) == (False, 2.5)
    assert (m.moe_shared_expert_intermediate_size, m.moe_first_k_dense_layers) == (2048, 3)
