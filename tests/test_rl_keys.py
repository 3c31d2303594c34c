"""RLinf's and SkyRL's Megatron keys (pinned surfaces generated from their sources) classified in one
table each: mapped, no effect (listed), not built (all refused at once), unknown (did-you-mean)."""
from __future__ import annotations

import ast
import textwrap

import pytest

from fivefold.config.keyed import MAPPED, NOT_BUILT, NOTE
from fivefold.config.load import load_config
from fivefold.config.rl_keys import RLINF, SKYRL, classify_rlinf, classify_skyrl
from fivefold.errors import NotImplementedYet, UserError


def _usual(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def test_every_rlinf_key_is_classified_and_the_usual_values_load():
    assert len(RLINF) > 60
    how = {key: classify_rlinf(key, _usual(v)).how for key, v in RLINF.items() if "${" not in v}
    assert set(how.values()) <= {MAPPED, NOTE, NOT_BUILT}
    assert [k for k, h in how.items() if h == NOT_BUILT] == []
    assert how["model.moe_router_bias_update_rate"] == MAPPED  # 0 in RLinf's examples (Megatron's default 1e-3)
    assert how["model.normalization"] == how["optim.lr"] == how["lr_sched.max_lr"] == MAPPED
    assert how["optim.overlap_grad_reduce"] == how["megatron.ddp_bucket_size"] == NOTE


def test_every_skyrl_field_is_classified():
    assert len(SKYRL) > 30 and SKYRL["tensor_model_parallel_size"] == "1"
    for key, default in SKYRL.items():
        assert classify_skyrl(key, "x9" if default != "-" else {}).how in (MAPPED, NOTE, NOT_BUILT), key
    assert classify_skyrl("transformer_config_kwargs.gated_linear_unit", True).pairs == [("model.activation", "swiglu")]
    assert classify_skyrl("optimizer_config_kwargs.lr", 1e-5).pairs == [("training.lr", 1e-5)]
    assert classify_skyrl("freeze_moe_router", True).how == NOT_BUILT


def test_an_rlinf_megatron_actor_section_loads_with_its_spelling(tmp_path):
    """RLinf's qwen2.5 Megatron example's actor section (values written out, no interpolations)."""
    f = tmp_path / "rlinf.yaml"
    f.write_text(textwrap.dedent("""\
        cluster: {num_nodes: 1, num_gpus_per_node: 8}
        actor:
          model:
            precision: bf16
            add_bias_linear: False
            add_qkv_bias: True
            tensor_model_parallel_size: 2
            pipeline_model_parallel_size: 1
            activation: swiglu
            sequence_parallel: True
            recompute_method: block
            recompute_granularity: full
            recompute_num_layers: 2
            seq_length: 64
            encoder_seq_length: 64
            normalization: rmsnorm
            position_embedding_type: rope
            apply_rope_fusion: True
            bias_dropout_fusion: False
            persist_layer_norm: False
            moe_token_dispatcher_type: alltoall
          optim: {optimizer: adam, bf16: True, lr: 1.0e-06, adam_beta2: 0.999, weight_decay: 0.01,
                  overlap_grad_reduce: False, use_distributed_optimizer: True, clip_grad: 1.0}
          lr_sched: {lr_warmup_iters: 0, max_lr: 1.0e-06, min_lr: 0.0, lr_decay_style: constant,
                     start_weight_decay: null, end_weight_decay: null}
          megatron: {ddp_bucket_size: null, distributed_backend: nccl, ckpt_format: torch, use_dist_ckpt: False}
        """))
    loaded = load_config(str(f))
    c = loaded.config
    assert loaded.dialect == "rlinf"
    assert (c.model.normalization, c.model.activation, c.training.precision, c.training.seq_length,
            c.training.lr, c.training.lr_decay_style, c.parallel.sequence_parallel) == \
        ("RMSNorm", "swiglu", "bf16", 64, 1e-6, "constant", True)
    assert "actor.optim.overlap_grad_reduce" in " ".join(map(str, loaded.warnings))


def test_seed_keys_load_in_both_tools():
    rl = load_config(None, ["actor.model.context_parallel_size=2", "actor.model.tensor_model_parallel_size=2"])
    sky = load_config(None, ["trainer.policy.megatron_config.context_parallel_size=2",
                             "trainer.megatron.tensor_model_parallel_size=2"])
    assert rl.config.parallel == sky.config.parallel and (rl.dialect, sky.dialect) == ("rlinf", "skyrl")


@pytest.mark.parametrize("words", [
    ["--moe-grouped-gemm", "--moe-per-layer-logging"],
    ["cfg.model.moe_grouped_gemm=true", "cfg.model.moe_per_layer_logging=true"],  # Megatron-Bridge
    ["actor.model.moe_grouped_gemm=te"],  # RLinf names the backend (its examples' 'te')
    ["trainer.policy.megatron_config.moe_grouped_gemm=true",
     "trainer.policy.megatron_config.moe_per_layer_logging=true"],  # SkyRL
])
def test_grouped_gemm_and_per_layer_logging_map_in_every_dialect(words):
    c = load_config(None, words).config
    assert c.model.moe_grouped_gemm is True
    assert c.logging.moe_per_layer_logging is (len(words) == 2)


def test_unknown_and_unbuilt_keys_are_refused_together():
    with pytest.raises(UserError, match=r"unknown config key actor.optim.adam_beta3 \(did you mean optim.adam_beta2"):
        load_config(None, ["actor.optim.adam_beta3=0.9"])
    with pytest.raises(UserError, match=r"trainer.megatron.tensor_model_paralel_size \(did you mean "
                                        r"tensor_model_parallel_size"):
        load_config(None, ["trainer.megatron.tensor_model_paralel_size=2"])
    with pytest.raises(NotImplementedYet, match=r"keys trainer.policy.megatron_config.freeze_moe_router, "
                                                r"actor.model.precision \('fp8'; built: .*\) .*not implemented yet"):
        load_config(None, ["trainer.policy.megatron_config.freeze_moe_router=true", "actor.model.precision=fp8"])
    with pytest.raises(UserError, match="an OmegaConf interpolation"):
        load_config(None, ["actor.model.seq_length=${runner.seq_length}"])
