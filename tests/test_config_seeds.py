"""Every configuration example of seeds 000-003, in its own dialect, and every case of NOTES.md."""
import copy
import textwrap

import pytest

from fivefold.config.bridge import apply_defaults as apply_bridge_defaults
from fivefold.config.load import load_config
from fivefold.config.megatron_defaults import DEFAULTS
from fivefold.config.schema import to_dict
from fivefold.config.validate import ConfigError, layout_of, validate


def yaml_file(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def resolved(path=None, words=(), **kw):
    loaded = load_config(path, list(words), **kw)
    warnings = validate(loaded.config, loaded.dialect)
    return loaded, warnings, layout_of(loaded.config)


def refused(path=None, words=(), **kw):
    loaded = load_config(path, list(words), **kw)
    with pytest.raises(ConfigError) as e:
        validate(loaded.config, loaded.dialect)
    return e.value


# ---- seed 000 (RLinf YAML; its indentation was lost in copying and is restored here) ----

def test_rlinf_sizing_example_gives_dp_16(tmp_path):
    loaded, _, lay = resolved(yaml_file(tmp_path, """
        cluster:
          num_nodes: 16
        actor:
          model:
            tensor_model_parallel_size: 2 # TP
            pipeline_model_parallel_size: 2 # PP
            context_parallel_size: 2 # CP
        """))
    assert loaded.dialect == "rlinf"
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.world_size) == (2, 2, 2, 16, 128)


@pytest.mark.parametrize("body, sizes", [
    ("tensor_model_parallel_size: 2", (2, 1, 1)),
    ("pipeline_model_parallel_size: 2", (1, 2, 1)),
    ("context_parallel_size: 2", (1, 1, 2)),
    ("tensor_model_parallel_size: 2\n    sequence_parallel: True", (2, 1, 1)),
    ("tensor_model_parallel_size: 1\n    sequence_parallel: False", (1, 1, 1)),
])
def test_rlinf_samples(tmp_path, body, sizes):
    _, _, lay = resolved(yaml_file(tmp_path, f"actor:\n  model:\n    {body}\n"))
    assert (lay.tp, lay.pp, lay.cp) == sizes and lay.dp == 8 // (sizes[0] * sizes[1] * sizes[2])


def test_rlinf_sp_with_tp1_must_be_disabled(tmp_path):
    e = refused(yaml_file(tmp_path, "actor:\n  model:\n    tensor_model_parallel_size: 1\n"
                                    "    sequence_parallel: True\n"))
    assert "sequence_parallel=False" in str(e)


# ---- seed 001 (Megatron-LM flags) ----

def test_megatron_tp4_on_4_gpus():
    _, _, lay = resolved(words="torchrun --nproc_per_node=4 train.py --tensor-model-parallel-size 4".split())
    assert (lay.tp, lay.dp, lay.world_size) == (4, 1, 4)


@pytest.mark.parametrize("launcher,world", [
    ("python -m torch.distributed.run --nproc_per_node=4", 4),   # the module form of torchrun
    ("torchrun --nproc_per_node=gpu --nnodes=2", 16),            # gpu: the node's GPUs (8 by default)
    ("torchrun --nnodes=1:2 --nproc-per-node 4", 8),             # elastic range: planned for its maximum
])
def test_torchrun_forms_as_torchrun_reads_them(launcher, world):
    _, _, lay = resolved(words=f"{launcher} train.py --tensor-model-parallel-size 4".split())
    assert (lay.tp, lay.world_size) == (4, world)


PP_EXAMPLE = ("torchrun --nproc_per_node=8 --nnodes=4 train.py --pipeline-model-parallel-size 4 "
              "--num-layers 80 --num-layers-per-virtual-pipeline-stage 2").split()


def test_megatron_interleaved_example_needs_microbatches_multiple_of_pp():
    # Default global batch = micro batch x DP = 8: one microbatch per DP rank, not a multiple of PP=4.
    e = refused(words=PP_EXAMPLE)
    assert "multiple of pipeline_model_parallel_size=4" in str(e)
    assert "global_batch_size=32" in str(e)
    loaded, _, lay = resolved(words=PP_EXAMPLE + ["--global-batch-size", "32"])
    p = loaded.config.parallel
    assert p.virtual_pipeline_model_parallel_size == 10 and p.pipeline_schedule == "interleaved"
    assert lay.dp == 8


def test_megatron_sp_and_cp_examples():
    _, _, lay = resolved(words="torchrun --nproc_per_node=8 train.py --tensor-model-parallel-size 4 "
                               "--sequence-parallel".split())
    assert (lay.tp, lay.dp) == (4, 2)
    loaded, _, lay = resolved(words="torchrun --nproc_per_node=8 train.py --context-parallel-size 2 "
                                    "--seq-length 32768".split())
    assert (lay.cp, lay.dp, loaded.config.training.seq_length) == (2, 4, 32768)


def test_megatron_mixtral_tp_ep_without_sp_warns_and_turns_sp_on():
    loaded, warnings, lay = resolved(words="torchrun --nproc_per_node=8 train.py --expert-model-parallel-size 4 "
                                           "--num-experts 8 --tensor-model-parallel-size 2".split())
    assert loaded.config.parallel.sequence_parallel is True
    assert any("SP turned on" in w.rule for w in warnings)
    assert (lay.dp, lay.ep, lay.etp, lay.edp) == (4, 4, 2, 1)


LLAMA70B = "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8".split()
LLAMA405B = ("--num-layers 126 --hidden-size 16384 --num-attention-heads 128 --group-query-attention --num-query-groups 8 "
             "--decoder-first-pipeline-num-layers 15 --decoder-last-pipeline-num-layers 15").split()
DSV3 = ("--num-layers 61 --hidden-size 7168 --num-attention-heads 128 --num-experts 256 --moe-router-topk 8 "
        "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2").split()


def test_megatron_3d_llama70b_on_64():
    _, _, lay = resolved(words="torchrun --nproc_per_node=8 --nnodes=8 train.py --tensor-model-parallel-size 4 "
                               "--pipeline-model-parallel-size 4".split() + LLAMA70B)
    assert (lay.tp, lay.pp, lay.dp, lay.world_size) == (4, 4, 4, 64)


def test_megatron_4d_llama405b_on_256():
    loaded, _, lay = resolved(words="torchrun --nproc_per_node=8 --nnodes=32 train.py "
                                    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                                    "--context-parallel-size 2".split() + LLAMA405B)
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.world_size) == (8, 8, 2, 2, 256)


FIVE_D = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 16 --expert-model-parallel-size 64".split()


def test_megatron_5d_deepseek_v3_needs_etp_1_on_1024():
    e = refused(words=FIVE_D + DSV3, world_size=1024)
    assert "ETP*EP = 2*64 = 128 must divide TP*CP*DP = 2*1*32 = 64" in str(e)
    assert "expert_tensor_parallel_size=1" in str(e)
    _, _, lay = resolved(words=FIVE_D + DSV3 + ["--expert-tensor-parallel-size", "1"], world_size=1024)
    assert (lay.dp, lay.ep, lay.etp, lay.edp) == (32, 64, 1, 1)


def test_megatron_full_block_recompute_needs_num_layers():
    e = refused(words="--recompute-granularity full --recompute-method block".split())
    assert "recompute_num_layers" in str(e) and "Megatron-LM refuses" in str(e)
    resolved(words="--recompute-granularity full --recompute-method block --recompute-num-layers 1".split())


def test_megatron_troubleshooting_flags_parse():
    loaded, _, _ = resolved(words=("--global-batch-size 1024 --micro-batch-size 1 "
                                   "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01 "
                                   "--num-experts 8 --expert-model-parallel-size 8 --profile --profile-ranks 0").split())
    c = loaded.config
    assert (c.training.global_batch_size, c.model.moe_aux_loss_coeff, c.logging.profile_ranks) == (1024, 0.01, [0])


def test_megatron_sp_with_tp1_warns_and_turns_sp_off():
    loaded, warnings, _ = resolved(words=["--sequence-parallel"])
    assert loaded.config.parallel.sequence_parallel is False and warnings[0].severity == "warning"


# ---- seed 002 (Megatron-Bridge `cfg.model.x` and SkyRL overrides) ----

def bridge(**sizes):
    return [f"cfg.model.{k}={v}" for k, v in sizes.items()]


def _ours_where_megatron_defaults(mega_cfg, ours_cfg) -> dict:
    """A Megatron command line's config with Megatron's defaults (config.megatron_defaults) put back
    to ours: the rest must be the same config."""
    ours, mega = to_dict(ours_cfg), to_dict(mega_cfg)
    for dotted in [*DEFAULTS, "model.max_position_embeddings"]:
        section, name = dotted.split(".")
        mega[section][name] = ours[section][name]
    return mega


def test_bridge_3d_is_the_same_config_as_megatron_flags_and_skyrl():
    a, _, lay = resolved(words=bridge(tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                                      sequence_parallel=True) + ["model.num_layers=80"], world_size=64)
    b, _, _ = resolved(words="--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
                             "--sequence-parallel --num-layers 80".split(), world_size=64)
    c, warnings, _ = resolved(words=["trainer.policy.megatron_config.tensor_model_parallel_size=4",
                                     "trainer.policy.megatron_config.pipeline_model_parallel_size=4",
                                     "trainer.megatron.num_layers=80"], world_size=64)
    assert (a.dialect, b.dialect, c.dialect) == ("megatron-bridge", "megatron", "skyrl")
    # Megatron flags mean Megatron's defaults for what they leave out (config.megatron_defaults), Bridge
    # keys Bridge's (config.bridge.apply_defaults); SkyRL builds from the HF model, so ours stay. With
    # each tool's defaults applied to SkyRL's config, the three are the same config.
    bridged = copy.deepcopy(c.config)
    apply_bridge_defaults(bridged, c.explicit)
    assert to_dict(a.config) == to_dict(bridged)
    assert to_dict(c.config) == _ours_where_megatron_defaults(b.config, c.config)
    assert lay.dp == 4
    assert "SkyRL turns sequence parallelism on" in warnings[0].rule


def test_rlinf_and_megatron_sizing_are_the_same_config(tmp_path):
    a, _, _ = resolved(yaml_file(tmp_path, "cluster:\n  num_nodes: 16\nactor:\n  model:\n"
                                           "    tensor_model_parallel_size: 2\n    pipeline_model_parallel_size: 2\n"
                                           "    context_parallel_size: 2\n"))
    b, _, _ = resolved(words="torchrun --nproc_per_node=8 --nnodes=16 train.py --tensor-model-parallel-size 2 "
                             "--pipeline-model-parallel-size 2 --context-parallel-size 2".split())
    assert to_dict(a.config) == _ours_where_megatron_defaults(b.config, a.config)


def test_bridge_4d_on_256():
    _, _, lay = resolved(words=bridge(tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                                      context_parallel_size=2, sequence_parallel=True)
                         + ["model.num_attention_heads=64", "model.num_layers=80"], world_size=256)
    assert (lay.dp, lay.cp) == (2, 2)


def test_bridge_deepseek_v2_on_128():
    _, _, lay = resolved(words=bridge(tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
                                      expert_model_parallel_size=32, sequence_parallel=False,
                                      num_moe_experts=160, num_layers=60), world_size=128)
    assert (lay.dp, lay.ep, lay.etp, lay.edp) == (32, 32, 1, 1)


@pytest.mark.parametrize("etp", [None, 1])
def test_bridge_deepseek_v3_on_256_is_invalid(etp):
    extra = [] if etp is None else [f"cfg.model.expert_tensor_parallel_size={etp}"]
    e = refused(words=bridge(tensor_model_parallel_size=2, pipeline_model_parallel_size=16,
                             expert_model_parallel_size=64, sequence_parallel=True, num_moe_experts=256,
                             num_layers=64) + extra, world_size=256)
    assert "must divide TP*CP*DP = 2*1*8 = 16" in str(e)


def test_bridge_sp_without_tp_is_an_error():
    e = refused(words=bridge(sequence_parallel=True))
    assert "needs tensor_model_parallel_size > 1" in str(e)


def test_bridge_cp_needs_seq_multiple_of_2cp():
    e = refused(words=bridge(context_parallel_size=4) + ["cfg.model.seq_length=4100"])
    assert "2*4=8; seq_length=4100 is not (fix: seq_length=4096)" in str(e)


def test_bridge_ep_on_dense_model_is_an_error():
    e = refused(words=bridge(expert_model_parallel_size=2))
    assert "needs a MoE model" in str(e)


def test_skyrl_sft_prefix():
    loaded, _, lay = resolved(words=["trainer.megatron.tensor_model_parallel_size=2"])
    assert loaded.dialect == "skyrl" and loaded.config.parallel.sequence_parallel and lay.tp == 2


# ---- seed 003 (AReaL) ----

def test_areal_legacy_allocation():
    loaded = load_config(None, ["allocation_mode=sglang.d2t2p1+d1t4p1"])
    gen, train = loaded.allocation.components
    assert gen.ranks == (0, 1, 2, 3) and (gen.layout.tp, gen.layout.dp) == (2, 2)
    assert train.ranks == (4, 5, 6, 7) and train.layout.tp == 4
    assert loaded.config.parallel.tensor_model_parallel_size == 4 and loaded.config.cluster.world_size == 4
    validate(loaded.config, loaded.dialect)
