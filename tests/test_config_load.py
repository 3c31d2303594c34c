"""Loading every dialect's surface into the canonical config."""
import pytest

from fivefold.config.load import load_config
from fivefold.config.validate import ConfigError, layout_of, validate
from fivefold.errors import UserError


def test_aliases_and_canonical_names_agree():
    a = load_config(None, ["tp=2", "pp=2", "cp=2", "sp=true"], world_size=16).config
    b = load_config(None, ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                           "parallel.context_parallel_size=2", "parallel.sequence_parallel=true"],
                    world_size=16).config
    assert a == b
    assert layout_of(a).dp == 2


def test_megatron_flags_map_to_canonical_fields():
    words = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --seq-length 128 "
             "--global-batch-size 16 --micro-batch-size 2 --lr 3e-4 --bf16 --profile --profile-ranks 0 3 "
             "--untie-embeddings-and-output-weights --use-distributed-optimizer "
             "--num-experts 4 --moe-router-topk 2 --moe-router-pre-softmax").split()
    loaded = load_config(None, words, world_size=8)
    c = loaded.config
    assert loaded.dialect == "megatron"
    assert (c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size) == (2, 2)
    assert (c.training.seq_length, c.training.global_batch_size, c.training.micro_batch_size) == (128, 16, 2)
    assert c.training.lr == 3e-4 and c.training.precision == "bf16"
    assert c.logging.profile and c.logging.profile_ranks == [0, 3]
    assert c.model.tie_word_embeddings is False and c.training.use_distributed_optimizer
    assert (c.model.num_experts, c.model.moe_router_topk, c.model.moe_router_pre_softmax) == (4, 2, True)


@pytest.mark.parametrize("words", [
    ["--tp-comm-overlap", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["cfg.comm_overlap.tp_comm_overlap=true", "cfg.model.tensor_model_parallel_size=2",
     "cfg.model.sequence_parallel=true"],
    ["cfg.model.tp_comm_overlap=true", "cfg.model.tensor_model_parallel_size=2", "cfg.model.sequence_parallel=true"],
    ["tp=2", "sp=true", "tp_comm_overlap=true"],
])
def test_tp_communication_overlap_is_read_in_each_dialect(words):
    """Megatron-LM's --tp-comm-overlap, both of Bridge's fields and the canonical name set one switch
    (the planner hides TP traffic only with it); Megatron-LM's rule holds: without sequence parallelism
    (as Megatron turns it off at TP1) it is refused with the fix."""
    loaded = load_config(None, words, world_size=8)
    assert loaded.config.parallel.tp_comm_overlap
    validate(loaded.config, loaded.dialect)
    plain = load_config(None, [w for w in words if "sequence" not in w and w != "sp=true"], world_size=8)
    with pytest.raises(ConfigError, match=r"tp_comm_overlap\) needs sequence parallelism .*fix: tp_comm_overlap=False"):
        validate(plain.config, plain.dialect)


@pytest.mark.parametrize("words", [
    ["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2", "--num-experts", "4", "--bf16"],
    ["cfg.comm_overlap.overlap_moe_expert_parallel_comm=true", "cfg.model.expert_model_parallel_size=2",
     "cfg.model.num_moe_experts=4", "cfg.model.bf16=true"],
    ["cfg.model.overlap_moe_expert_parallel_comm=true", "cfg.model.expert_model_parallel_size=2",
     "cfg.model.num_moe_experts=4", "cfg.model.bf16=true"],
])
def test_the_1f1b_all_to_all_overlap_is_read_in_megatron_and_bridge_words(words):
    """Megatron-LM's flag and both of Bridge's fields set the one canonical switch; Bridge's comm_overlap
    None (its default: the model's setting stands) sets nothing."""
    assert load_config(None, words, world_size=8).config.parallel.overlap_moe_expert_parallel_comm
    kept = load_config(None, ["cfg.comm_overlap.overlap_moe_expert_parallel_comm=None", "cfg.model.num_moe_experts=4"],
                       world_size=8)
    assert not kept.config.parallel.overlap_moe_expert_parallel_comm


@pytest.mark.parametrize("words", [
    ["--microbatch-group-size-per-virtual-pipeline-stage", "3"], ["cfg.model.microbatch_group_size_per_vp_stage=3"]])
def test_interleavings_microbatch_group_is_read_in_megatron_and_bridge_words(words):
    """Megatron-LM's flag and Bridge's field set the group; 6 microbatches on PP2 interleaved in groups of
    3 are valid (Megatron's rule), and without interleaving the group is ignored with a warning, as
    Megatron-LM ignores it."""
    sizes = ["pp=2", "vpp=2", "num_layers=4", "global_batch_size=6", "micro_batch_size=1"]
    cfg = load_config(None, sizes + words, world_size=2).config
    validate(cfg)
    assert cfg.parallel.microbatch_group_size_per_vp_stage == 3
    flat = load_config(None, ["pp=2", "num_layers=4"] + words, world_size=2).config
    [warned] = validate(flat)
    assert "only the interleaved schedule has (this one: 1f1b); ignored" in str(warned)
    assert flat.parallel.microbatch_group_size_per_vp_stage is None


@pytest.mark.parametrize("words", [["--cp-comm-type", "allgather"], ["--cp-comm-type", "all_gather"],
                                   ["cfg.model.cp_comm_type=all_gather"], ["cfg.model.cp_comm_type=[all_gather,all_gather]"],
                                   ["parallel.cp_comm_type=allgather"]])
def test_all_gather_cp_is_read_in_each_spelling(words):
    """Megatron-LM's help says allgather, TransformerConfig and TransformerEngine all_gather, Bridge's field
    is a per-layer list: one canonical allgather (the planner models it; `train` refuses it); different
    exchanges per layer are not built."""
    cfg = load_config(None, ["cp=2", "num_layers=2"] + words, world_size=2).config
    validate(cfg)
    assert cfg.parallel.cp_comm_type == "allgather"
    with pytest.raises(UserError, match=r"cp_comm_type \['all_gather', 'p2p'\] .*not implemented yet"):
        load_config(None, ["cfg.model.cp_comm_type=[all_gather,p2p]"], world_size=2)


@pytest.mark.parametrize("words", [["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
                                   ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--bf16"],
                                   ["cfg.mixed_precision=bf16_with_mxfp8_mixed"],
                                   ["cfg.model.fp8=hybrid", "cfg.model.fp8_recipe=mxfp8", "cfg.model.bf16=true"]])
def test_fp8_is_read_in_megatron_and_bridge_words(words):
    """Megatron-LM's --fp8-format beside --bf16 (in either order), Bridge's fp8 recipe names and its
    TransformerConfig fields: fp8 GEMMs on bf16 parameters with the named scaling (for the planner;
    `train` refuses fp8). Megatron's custom quantizer recipe is refused with the built ones."""
    cfg = load_config(None, ["num_layers=2"] + words, world_size=8).config
    validate(cfg)
    assert (cfg.training.precision, cfg.training.fp8_format, cfg.training.fp8_recipe) == ("fp8", "hybrid", "mxfp8")
    custom = load_config(None, ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "custom"], world_size=8).config
    with pytest.raises(ConfigError, match="training.fp8_recipe='custom': must be one of delayed, tensorwise, blockwise, mxfp8"):
        validate(custom)


def test_the_token_dispatcher_is_megatrons():
    """--moe-token-dispatcher-type names the canonical field (alltoall_seq, removed from Megatron-LM, read as
    alltoall); a Megatron command line or an all-Bridge config of a MoE model without it gets their
    default, allgather (said among the defaults); our own dialect keeps alltoall."""
    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2"]
    for given, want in ((["--moe-token-dispatcher-type", "flex"], "flex"), (["--moe-token-dispatcher-type", "alltoall_seq"],
                                                                              "alltoall"), ([], "allgather")):
        assert load_config(None, moe + given, world_size=8).config.parallel.moe_token_dispatcher_type == want
    assert load_config(None, ["model.num_experts=4", "ep=2"], world_size=8).config.parallel.moe_token_dispatcher_type \
        == "alltoall"
    bridge = load_config(None, ["cfg.model.num_moe_experts=4", "cfg.model.expert_model_parallel_size=2"], world_size=8)
    assert bridge.config.parallel.moe_token_dispatcher_type == "allgather"  # Bridge's TransformerConfig default


@pytest.mark.parametrize("words, hint", [
    (["--tensor-model-paralel-size", "2"], "--tensor-model-parallel-size"),
    (["parallel.tensor_model_paralel_size=2"], "parallel.tensor_model_parallel_size"),
    (["model.hidden_sise=8"], "model.hidden_size"),
    (["parallel.num_layers=4"], "model.num_layers"),
    (["parallel.tp=2"], "parallel.tensor_model_parallel_size, or tp alone"),  # a short name under a section
    (["model.ep=2"], "parallel.expert_model_parallel_size, or ep alone"),
])
def test_unknown_keys_suggest_the_right_one(words, hint):
    with pytest.raises(UserError, match="did you mean") as e:
        load_config(None, words)
    assert hint in str(e.value)


def test_a_section_given_a_value_is_named_as_a_section(tmp_path):
    """`parallel=3` or a YAML `parallel: 3` / a list: the section named as one, with how to give its
    fields (it said "unknown config key 'parallel' (did you mean parallel.order?)")."""
    listed = tmp_path / "c.yaml"
    listed.write_text("model:\n  - 1\n")
    for config, words in ((None, ["parallel=3"]), (listed, [])):
        with pytest.raises(UserError, match="is a section, not a value: give its fields") as e:
            load_config(config, words)
        assert "did you mean" not in str(e.value)


def test_validate_lists_every_problem_with_a_fix():
    loaded = load_config(None, ["tp=3", "sp=true", "--recompute-granularity", "full",
                                "--recompute-method", "block"], world_size=8)
    with pytest.raises(ConfigError) as e:
        validate(loaded.config, loaded.dialect)
    assert "tensor_model_parallel_size=3" in str(e.value)
    assert "recompute_num_layers" in str(e.value)


def test_one_node_may_use_part_of_its_gpus_several_nodes_are_filled(tmp_path):
    """A config written back by a run (`to_dict`: world_size 2 beside the default 1 node x 8) loads: one
    node may run on fewer of its GPUs. Several nodes are filled GPU by GPU, so a world size that is not
    nodes x GPUs per node is refused with both fixes."""
    one = tmp_path / "one.yaml"
    one.write_text("cluster:\n  num_nodes: 1\n  gpus_per_node: 8\n  world_size: 2\n")
    assert load_config(one, []).config.cluster.resolved_world_size == 2
    two = tmp_path / "two.yaml"
    two.write_text("cluster:\n  num_nodes: 2\n  gpus_per_node: 8\n  world_size: 2\n")
    with pytest.raises(UserError, match="give one: world_size=16"):
        load_config(two, [])


def test_a_key_given_twice_in_a_yaml_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys silently: a second `training:` section replaced the first
    whole (its lr gone), a repeated `lr:` took the later one. Refused naming the key and both lines, as
    OmegaConf (Megatron-Bridge, RLinf, SkyRL) refuses it; a key merged in with `<<` may be overridden."""
    f = tmp_path / "c.yaml"
    for text, key, first, again in (("training:\n  lr: 1.0e-3\n  train_iters: 5\n  lr: 1.0e-2\n", "lr", 2, 4),
                                    ("training:\n  lr: 1.0e-3\nmodel:\n  num_layers: 2\ntraining:\n  train_iters: 5\n",
                                     "training", 1, 5)):
        f.write_text(text)
        said = rf"found the key '{key}' again \(first on line {first}\)(.|\n)*line {again}"
        with pytest.raises(UserError, match=said):
            load_config(str(f))
    f.write_text("defaults: &d {lr: 1.0e-3, train_iters: 5}\ntraining:\n  <<: *d\n  lr: 1.0e-2\n")
    from fivefold.config.load import parse_yaml
    assert parse_yaml(f)["training"] == {"lr": 1.0e-2, "train_iters": 5}
