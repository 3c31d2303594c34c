"""Megatron-Bridge's config surface (pinned, generated from its sources) classified: mapped, no effect
(listed by `validate`), not built (all refused at once), or unknown (did-you-mean); Bridge's defaults
where an all-Bridge config leaves a field out."""
from __future__ import annotations

import pytest
import yaml

from fivefold.config import bridge
from fivefold.config.keyed import MAPPED, NOT_BUILT, NOTE
from fivefold.config.load import load_config
from fivefold.errors import NotImplementedYet, UserError

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             vocab_size=256, seq_length=64, gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False,
             position_embedding_type="rope", share_embeddings_and_output_weights=False, hidden_dropout=0.0,
             attention_dropout=0.0, tensor_model_parallel_size=2, sequence_parallel=True)
OTHER = {"train.global_batch_size": 8, "train.micro_batch_size": 2, "train.train_iters": 5, "optimizer.lr": 3e-4,
         "optimizer.weight_decay": 0.1, "optimizer.adam_beta2": 0.95, "scheduler.lr_decay_style": "cosine",
         "rng.seed": 7, "mixed_precision": "bf16_mixed"}
MEGATRON = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
            "--num-query-groups 2 --vocab-size 256 --seq-length 64 --swiglu --normalization RMSNorm "
            "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
            "--hidden-dropout 0.0 --attention-dropout 0.0 --tensor-model-parallel-size 2 --sequence-parallel "
            "--global-batch-size 8 --micro-batch-size 2 --train-iters 5 --lr 3e-4 --weight-decay 0.1 "
            "--adam-beta2 0.95 --lr-decay-style cosine --seed 7 --bf16").split()


def bridge_words(prefix: str = "cfg.") -> list[str]:
    return [f"{prefix}model.{k}={v}" for k, v in MODEL.items()] + [f"{prefix}{k}={v}" for k, v in OTHER.items()]


def test_the_surface_is_bridges_and_every_field_is_classified():
    assert bridge.SURFACE_FILE.read_text().startswith("# Megatron-Bridge config surface at commit 067f987df0 "
                                                      "(Megatron-LM d98e8a64dd)")
    assert len(bridge.SURFACE) > 800 and bridge.SURFACE["model.gated_linear_unit"] == ("bool", False)
    seen = {}
    for key, (kind, default) in bridge.SURFACE.items():
        if kind == "bool" and default in (True, False, None):
            other = not default
        else:
            other = "x9" if kind == "value" else ["x9"]
        seen[key] = bridge.classify(key, other).how
        assert seen[key] in (MAPPED, NOTE, NOT_BUILT), key
    counts = {how: sum(1 for h in seen.values() if h == how) for how in (MAPPED, NOTE, NOT_BUILT)}
    assert counts[MAPPED] > 100 and counts[NOTE] > 300 and counts[NOT_BUILT] > 200, counts
    assert seen["model.fp8"] == MAPPED  # fp8 for the planner (`train` refuses it)
    assert all(seen[k] == NOT_BUILT for k in ("model.fp4", "model.window_size", "optimizer.decoupled_lr",
                                              "scheduler.weight_decay_incr_style"))
    assert all(seen[k] == NOTE for k in ("logger.log_throughput", "ddp.overlap_grad_reduce", "model.batch_p2p_comm",
                                         "checkpoint.fully_parallel_save", "ft.enable_ft_package"))


def test_a_bridge_config_is_the_same_megatron_command_line_and_the_same_yaml(tmp_path):
    want = load_config(None, MEGATRON).config
    words = load_config(None, bridge_words())
    assert words.dialect == "megatron-bridge" and words.config == want
    yaml_file = tmp_path / "bridge.yaml"  # Bridge's own YAML (a ConfigContainer's sections, no cfg.)
    sections: dict = {"model": MODEL}
    for key, value in OTHER.items():
        section, _, name = key.partition(".")
        if name:
            sections.setdefault(section, {})[name] = value
        else:  # mixed_precision: a recipe name
            sections[section] = value
    yaml_file.write_text(yaml.safe_dump(sections))
    assert load_config(str(yaml_file)).config == want
    assert load_config(None, bridge_words(prefix="")).config == want  # OmegaConf overrides without cfg.


def test_values_that_mean_something_else_are_translated():
    m = load_config(None, ["cfg.model.gated_linear_unit=False", "cfg.model.share_embeddings_and_output_weights=True",
                           "cfg.model.num_moe_experts=8", "cfg.model.layernorm_zero_centered_gamma=true",
                           "cfg.model.params_dtype=torch.bfloat16"]).config
    assert (m.model.activation, m.model.tie_word_embeddings, m.model.num_experts, m.model.apply_layernorm_1p,
            m.training.precision) == ("gelu", True, 8, True, "bf16")


def test_precision_aware_optimizer_dtypes_are_torch_dtypes_in_bridge():
    """OptimizerConfig holds the optimizer state's dtypes as torch dtypes (fp8: torch.uint8, as Megatron-LM
    maps --exp-avg-dtype fp8), and TransformerConfig's fp8_param is --fp8-param-gather."""
    t = load_config(None, ["cfg.optimizer.exp_avg_dtype=torch.bfloat16", "cfg.optimizer.exp_avg_sq_dtype=torch.uint8",
                           "cfg.optimizer.main_params_dtype=torch.float16", "cfg.model.fp8_param=True"]).config.training
    assert (t.exp_avg_dtype, t.exp_avg_sq_dtype, t.main_params_dtype) == ("bf16", "fp8", "fp16")
    assert t.fp8_param_gather
    assert bridge.classify("mixed_precision.fp8_param", None).pairs == []  # Bridge: "as fp8_param_gather"


def test_bridges_defaults_fill_a_bridge_config_with_our_keys_mixed_in():
    loaded = load_config(None, ["cfg.model.num_layers=2", "cfg.model.hidden_size=64", "cfg.model.num_attention_heads=4"])
    m = loaded.config.model  # TransformerConfig's defaults, not Megatron-LM's CLI (4h MLP with or without a GLU)
    assert (m.normalization, m.activation, m.add_bias_linear, m.hidden_dropout, m.tie_word_embeddings,
            m.position_embedding_type, m.ffn_hidden_size, loaded.config.training.seq_length,
            loaded.config.training.adam_beta2) == ("LayerNorm", "gelu", True, 0.1, True, "learned_absolute", 256, 1024,
                                                   0.999)
    assert "megatron-bridge defaults" in " ".join(map(str, loaded.warnings))
    # one of our keys mixed in (training.seq_length, data.mock_data) keeps Bridge's defaults, with the note; it
    # dropped every one of them, and the model turned RMSNorm / SwiGLU / RoPE / untied under a "megatron-bridge" dialect
    mixed = load_config(None, ["cfg.model.num_layers=2", "training.seq_length=64", "data.mock_data=true"])
    assert mixed.dialect == "megatron-bridge"
    assert (mixed.config.model.normalization, mixed.config.model.activation, mixed.config.model.tie_word_embeddings,
            mixed.config.model.position_embedding_type, mixed.config.training.seq_length) == \
        ("LayerNorm", "gelu", True, "learned_absolute", 64)
    assert "megatron-bridge defaults" in " ".join(map(str, mixed.warnings))


def test_a_tools_flags_on_our_yaml_add_none_of_its_defaults_and_our_keys_on_its_file_drop_none(tmp_path):
    """The file's dialect decides: a Megatron flag over our YAML (the README's `examples/demo.yaml
    --tensor-model-parallel-size 1`) keeps our defaults; our key over a Megatron flag file keeps Megatron's."""
    ours = load_config("examples/demo.yaml", ["--tensor-model-parallel-size", "1"]).config.model
    assert (ours.normalization, ours.activation) == ("RMSNorm", "swiglu")
    flags = tmp_path / "flags.txt"
    flags.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64\n")
    theirs = load_config(str(flags), ["data.mock_data=true", "tp=1"])
    assert theirs.dialect == "megatron"
    assert (theirs.config.model.normalization, theirs.config.model.activation) == ("LayerNorm", "gelu")
    assert "megatron defaults" in " ".join(map(str, theirs.warnings))


def test_sections_named_like_ours_go_to_ours_first():
    loaded = load_config(None, ["model.num_layers=3", "model.num_moe_experts=4", "checkpoint.save=out",
                                "checkpoint.most_recent_k=2"])
    assert (loaded.config.model.num_layers, loaded.config.model.num_experts, loaded.config.checkpoint.save) == \
        (3, 4, "out")
    assert "checkpoint.most_recent_k: checkpoint format and I/O" in " ".join(map(str, loaded.warnings))


def test_unknown_key_gets_did_you_mean_and_unbuilt_keys_are_named_at_once():
    with pytest.raises(UserError, match=r"unknown config key cfg.model.num_experts \(did you mean "
                                        r"model.num_moe_experts"):
        load_config(None, ["cfg.model.num_experts=8"])
    with pytest.raises(NotImplementedYet) as e:
        load_config(None, ["cfg.model.fp4=e2m1", "cfg.optimizer.decoupled_lr=1e-3", "cfg.model.num_layers=2",
                           "cfg.mixed_precision=bf16_with_nvfp4_mixed"])
    assert str(e.value).startswith("keys cfg.model.fp4, cfg.optimizer.decoupled_lr, cfg.mixed_precision (mixed_precision"
                                   "=bf16_with_nvfp4_mixed (built recipes:")
    assert str(e.value).endswith("not implemented yet")


def test_fields_at_bridges_default_are_accepted_whatever_they_are():
    """A dumped Bridge config names every field; one at Bridge's default builds nothing, so it is noted."""
    loaded = load_config(None, ["cfg.model.fp4=None", "cfg.model.window_size=None", "cfg.model.num_layers=2"])
    assert "cfg.model.fp4: Bridge's default" in " ".join(map(str, loaded.warnings))
