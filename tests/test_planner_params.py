"""Preset parameter counts against the figures the models' authors publish (each preset names its
source), and the HF config.json reader against transformers' own config classes."""
import json

import pytest

from fivefold.errors import UserError
from fivefold.config.hf import load_hf_config, model_from_hf_dict
from fivefold.planner.memory.params import count_params
from fivefold.planner.presets import MODEL_PRESETS, model_preset


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_preset_matches_published_counts(name):
    preset = MODEL_PRESETS[name]
    c = count_params(preset.model)
    total, active = c.total, c.active
    if preset.excludes_embedding:  # the source says (or its numbers show) embeddings are left out
        total, active = total - c.embedding, active - c.embedding
    # 3%: the bar; published figures are rounded (e.g. "37B") and leave out QK-norm / biases
    # (< 0.01%), so a wrong width or layer count (>= 3%) is what this catches.
    assert abs(total / preset.published_total - 1) < 0.03, (name, total, preset.source)
    assert abs(active / preset.published_active - 1) < 0.03, (name, active, preset.source)


def test_counts_closed_form_llama3_8b():
    # Exact: 2*V*h + L*(2h*a*d + 2h*g*d + 3h*f + 2h) + h, V=128256, h=4096, L=32, a=32, g=8, d=128, f=14336.
    h, V, L, f = 4096, 128256, 32, 14336
    expected = 2 * V * h + L * (2 * h * 4096 + 2 * h * 1024 + 3 * h * f + 2 * h) + h
    assert count_params(model_preset("llama3-8b").model).total == expected == 8_030_261_248


def test_hf_reader_matches_presets():
    transformers = pytest.importorskip("transformers")
    v3 = transformers.DeepseekV3Config().to_dict()  # its defaults are DeepSeek-V3's published config
    m = model_from_hf_dict(v3)
    assert count_params(m).total == count_params(model_preset("deepseek-v3").model).total
    mix = transformers.MixtralConfig().to_dict()  # defaults: Mixtral-8x7B
    assert count_params(model_from_hf_dict(mix)).total == count_params(model_preset("mixtral-8x7b").model).total
    # Qwen/Qwen3-30B-A3B config.json values (transformers 5 leaves num_experts and head_dim unset by default).
    q = transformers.Qwen3MoeConfig(num_hidden_layers=48, num_experts=128, head_dim=128).to_dict()
    assert count_params(model_from_hf_dict(q)).active == count_params(model_preset("qwen3-30b-a3b").model).active


def test_hf_reader_llama_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
           "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_hf_config(tmp_path)
    assert count_params(m).total == count_params(model_preset("llama3-70b").model).total


def test_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="unknown model preset"):
        model_preset("gpt-5")
    with pytest.raises(UserError, match="no such config.json"):
        load_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="malformed JSON"):
        load_hf_config(bad)
    bad.write_text('{"hidden_size": 64, "num_hidden_layers": 2, "hidden_size": 128}')  # json kept the last
    with pytest.raises(UserError, match="key 'hidden_size' given twice: keep one"):
        load_hf_config(bad)
    bad.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(UserError, match="num_attention_heads"):
        load_hf_config(bad)
    # counts are whole numbers: 2.7 layers was truncated to 2 and "32" read as 32, silently
    llama = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
             "intermediate_size": 128}
    for key, value in (("num_hidden_layers", 2.7), ("num_hidden_layers", "32"), ("vocab_size", True),
                       ("num_key_value_heads", 1.5)):
        bad.write_text(json.dumps({**llama, key: value}))
        with pytest.raises(UserError, match=rf"config.json: {key}={value!r} is not a whole number"):
            load_hf_config(bad)
    bad.write_text(json.dumps({**llama, "num_hidden_layers": 2.0, "num_key_value_heads": None}))
    assert load_hf_config(bad).num_layers == 2  # as JSON may write a count; null: the default (all heads)
    bad.write_text(json.dumps({**llama, "kv_lora_rank": 16}))  # MLA without its head sizes
    with pytest.raises(UserError, match="config.json has no 'qk_nope_head_dim'"):
        load_hf_config(bad)
