"""DeepSeek-V3 checkpoints with MoE layers (model_type deepseek_v3; Moonlight; kimi_k2) against HF
transformers' DeepseekV3ForCausalLM, fp32 on CPU, random small configs written by save_pretrained:

- import: our logits, loss and every gradient equal HF's on 3 layers, the first dense
  (first_k_dense_replace=1), MLA with compressed queries, sigmoid routing with a nonzero
  e_score_correction_bias that changes the choice, shared experts, and either group-limited routing
  (n_group 4, topk_group 2, top-4 of 16: a group scores its top 2) with norm_topk_prob and
  routed_scaling_factor 2.5, or one group (Moonlight, Kimi-K2) without renormalisation;
- export: import -> `fivefold export` gives HF's tensors back bit for bit (the fp32 bias included) and
  a config.json from which transformers builds the same model (its logits equal the original's);
- multi-token prediction layers in the folder (model.layers.<num_hidden_layers>.*) are skipped with a
  note; kimi_k2 reads as deepseek_v3; routing HF computes otherwise than we do is refused naming the key.
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
from fivefold.model.hf import config_from_hf, hf_name, load_hf

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
    from fivefold.model.hf import read_hf_shards

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


def test_mtp_layers_are_skipped_with_a_note(saved, tmp_path, capsys):
    from fivefold.config.load import load_config

    folder, theirs = saved["one-group"]
    cfg = config_from_hf(folder)
    _with_mtp_layer(folder, tmp_path / "mtp", cfg)
    ours = load_hf(tmp_path / "mtp")
    assert "skipping 1 layer(s) past num_hidden_layers=3 (model.layers.3.*" in capsys.readouterr().out
    ids, _ = _batch()
    with torch.no_grad():
        assert torch.equal(ours(ids), load_hf(folder)(ids))  # the same tensors read, MTP's ignored
    loaded = load_config(None, ["--load-hf", str(tmp_path / "mtp"), "--seq-length", "16", "--train-iters", "1"])
    assert any("multi-token prediction" in str(w) for w in loaded.warnings)


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
    import test_moe
    import test_zero
    from _train_util import corpus, losses, one_process_context
    from fivefold.cli.train import prepare
    from fivefold.config.load import load_config
    from fivefold.config.schema import to_dict
    from fivefold.train.loop import train

    folder, _ = saved["groups"]
    data = corpus(tmp_path / "corpus")
    words = ["--load-hf", str(folder), "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
             "--train-iters", "2", "--lr", "1e-3", f"data.path={data}"]
    cfg = load_config(None, words).config
    data_dir = prepare(cfg, tmp_path)
    (tmp_path / "one").mkdir()
    with test_moe._one_thread():  # as every worker rank runs
        ref = train(cfg, one_process_context(tmp_path / "one"), data_dir, progress=False)
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
    from fivefold.model.hf_export import hf_config

    cfg = config_from_hf(saved["groups"][0])
    assert hf_config(cfg, torch.float32)["n_group"] == 4
    with pytest.raises(NotImplementedYet, match=message):
        hf_config(replace(cfg, **change), torch.float32)


def test_planner_reads_deepseek_v3s_published_router():
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's config.json: 256 experts, top-8 within
    4 of 8 groups, routed_scaling_factor 2.5, renormalised, shared expert 2048 wide, 3 dense layers."""
    from fivefold.planner.hf import model_from_hf_dict

    m = model_from_hf_dict({**DeepseekV3Config().to_dict(), "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    assert (m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk) == (256, 8, 8, 4)
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (m.moe_router_pre_softmax, m.moe_router_topk_scaling_factor) == (False, 2.5)
    assert (m.moe_shared_expert_intermediate_size, m.moe_first_k_dense_layers) == (2048, 3)
