"""Loading a Hugging Face checkpoint directory written by save_pretrained, and refusing bad ones."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaForCausalLM

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError
from fivefold.config.hf import config_from_hf
from fivefold.hf.load import load_hf
from tests._model_util import hf_config

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=24,
                  ffn_hidden_size=96, vocab_size=300, rotary_base=5000.0, norm_epsilon=1e-6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One HF-initialised model saved twice: a single model.safetensors and sharded with an index."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(CFG)).float().eval()
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (single / "model.safetensors").is_file()
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    return single, sharded


@pytest.mark.parametrize("which", [0, 1], ids=["single", "sharded"])
def test_loaded_checkpoint_gives_the_logits_transformers_gives(saved, which):
    path = saved[which]
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").float()(input_ids=ids).logits
        ours = load_hf(path)(ids)[..., : CFG.vocab_size]
    # Same fp32 math with different kernels (see test_model_hf): ulp-level noise, measured worst 2.1e-7
    # absolute (0.01 of the bound) over the CPU kernel settings.
    close(ours, ref, rtol=1e-4, atol=1e-5, site="hf_load.logits", case=["single", "sharded"][which])


def test_config_is_read_back_including_rope_parameters(saved):
    cfg = config_from_hf(saved[0])
    for key in ("num_layers", "hidden_size", "num_attention_heads", "kv_heads", "head_dim", "ffn_size",
                "vocab_size", "rotary_base", "norm_epsilon", "tie_word_embeddings"):
        assert getattr(cfg, key) == getattr(CFG, key), key


def test_a_pipeline_stage_loads_its_own_part(saved):
    stage = load_hf(saved[1], layers=[1], embedding=False)
    full = load_hf(saved[1])
    assert set(stage.state_dict()) == {n for n in full.state_dict()
                                       if n.startswith("layers.1.") or n in ("final_norm.weight", "head.weight")}
    for name, p in stage.state_dict().items():
        assert torch.equal(p, full.state_dict()[name]), name  # read from the same bytes: bit-exact


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoint_directories_are_user_errors(saved, tmp_path):
    single, sharded = saved
    with pytest.raises(UserError, match="not a directory"):
        load_hf(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no such config.json"):
        load_hf(empty)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(single / "config.json", no_weights / "config.json")
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"no model.safetensors or .*pytorch_model.bin, which are pickles"):
        load_hf(no_weights)

    lost_shard = _copy(sharded, tmp_path / "lost_shard")
    shard = sorted(lost_shard.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(UserError, match=f"lists {shard.name}, which is missing"):
        load_hf(lost_shard)

    misfiled = _copy(sharded, tmp_path / "misfiled")
    index = json.loads((misfiled / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(f for f in shards if f != index["weight_map"]["model.norm.weight"])
    index["weight_map"]["model.norm.weight"] = wrong
    (misfiled / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=f"{wrong}: has no tensor 'model.norm.weight', which the index puts there"):
        load_hf(misfiled)

    other = _copy(single, tmp_path / "other_shape")
    conf = json.loads((other / "config.json").read_text())
    conf["intermediate_size"] = 128
    (other / "config.json").write_text(json.dumps(conf))
    with pytest.raises(UserError, match=r"mlp.gate_proj.weight has shape \[96, 64\], config.json implies \[128, 64\]"):
        load_hf(other)

    damaged = _copy(single, tmp_path / "damaged")
    (damaged / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="model.safetensors: not a readable safetensors file"):
        load_hf(damaged)

    for key, value, message in [("model_type", "gpt2", "model_type='gpt2'"),
                                ("attention_bias", True, "attention_bias=True"),
                                ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                                 "rope_type='yarn'")]:
        odd = _copy(single, tmp_path / f"odd_{key}")
        conf = json.loads((odd / "config.json").read_text())
        conf[key] = value
        (odd / "config.json").write_text(json.dumps(conf))
        with pytest.raises(UserError, match=message):
            config_from_hf(odd)
