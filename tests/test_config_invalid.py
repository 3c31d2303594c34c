"""A table of invalid configs: each refused with its own message, each proposed fix itself valid."""
import pytest

from fivefold.config.load import load_config
from fivefold.config.validate import ConfigError, validate
from fivefold.errors import UserError

CASES = [  # (words, world size, substring of the message)
    ("tp=3", 8, "TP*PP*CP = 3*1*1 = 3 must divide the world size 8"),
    ("pp=3", 8, "TP*PP*CP = 1*3*1 = 3"),
    ("cp=3", 12, "2*3=6; seq_length=64 is not"),
    ("sp=true", 8, "sequence parallelism needs tensor_model_parallel_size > 1"),
    ("tp=2 sp=true seq_length=63", 8, "seq_length/CP = 63/1 divisible by tensor_model_parallel_size=2"),
    ("cp=2 seq_length=66", 8, "2*2=4; seq_length=66 is not"),
    ("tp=8 num_attention_heads=4", 8, "attention heads must divide evenly over tensor_model_parallel_size=8"),
    ("num_attention_heads=8 num_query_groups=3", 8, "num_attention_heads=8 must be a multiple"),
    ("tp=4 num_attention_heads=12 num_query_groups=6", 8, "KV heads must be divisible by TP=4"),
    ("pp=4 num_layers=6", 8, "6 layers do not split evenly into pp*vpp=4*1=4"),
    ("pp=2 vpp=2 num_layers=6 global_batch_size=8", 8, "6 layers do not split evenly into pp*vpp=2*2=4"),
    ("vpp=2 num_layers=4", 8, "needs pipeline_model_parallel_size > 1"),
    ("pp=2 vpp=2 num_layers=8 global_batch_size=4", 8, "number of microbatches (1) to be a multiple"),
    # Megatron-LM's microbatch groups for interleaving (4 DP ranks: microbatches = global batch / 4)
    ("pp=2 vpp=2 num_layers=8 global_batch_size=28 microbatch_group_size_per_vp_stage=3", 8,
     "the last group of microbatches (7 mod microbatch_group_size_per_vp_stage=3 = 1) must be empty or at least"),
    ("pp=2 vpp=2 num_layers=8 global_batch_size=16 microbatch_group_size_per_vp_stage=5", 8,
     "microbatch_group_size_per_vp_stage=5 must lie in [pipeline_model_parallel_size=2, the number of microbatches=4]"),
    ("pp=4 vpp=2 num_layers=8 global_batch_size=12 microbatch_group_size_per_vp_stage=2", 8,
     "microbatch_group_size_per_vp_stage=2 must lie in [pipeline_model_parallel_size=4"),
    ("pp=2 vpp=2 num_layers=4 microbatch_group_size_per_vp_stage=0", 8,
     "microbatch_group_size_per_vp_stage=0: must be >= 1 or unset"),
    ("trace_schedule=true", 8, "logging.trace_schedule=True: times the pipeline's actions of the last step"),
    ("ep=2", 8, "expert parallelism needs a MoE model"),
    ("ep=4 num_experts=6", 8, "num_experts=6 must be divisible by expert_model_parallel_size"),
    ("tp=2 sp=true ep=8 num_experts=8", 8, "ETP*EP = 2*8 = 16 must divide TP*CP*DP = 2*1*4 = 8"),
    ("recompute_granularity=full recompute_method=uniform", 8, "full recompute with method uniform"),
    ("cp=2 cp_comm_type=a2a num_attention_heads=3", 8, "heads per TP rank divisible by CP=2"),
    ("cp=4 cp_comm_type=a2a+p2p", 8, "hierarchical_context_parallel_sizes [a2a, p2p] whose product is CP=4"),
    ("cp=4 cp_comm_type=a2a+p2p hierarchical_context_parallel_sizes=[2,4]", 8, "[2, 4]"),
    ("cp=4 cp_comm_type=a2a+p2p hierarchical_context_parallel_sizes=[4,1] num_attention_heads=6", 8,
     "6 heads per TP rank divisible by the all-to-all size 4"),
    # counts, intervals and optimizer numbers out of range (Megatron's LR scheduler and torch's AdamW
    # assert most; a negative interval or clip ran as something else)
    ("train_iters=0", 8, "training.train_iters=0: must be >= 1"),
    ("lr=-0.1", 8, "training.lr=-0.1: must be a finite number >= 0"),
    ("lr=1e-4 min_lr=1e-3", 8, "training.min_lr=0.001: must be in [0, lr=0.0001]"),
    ("lr_warmup_init=0.5", 8, "training.lr_warmup_init=0.5: must be in [0, lr=0.001]"),
    ("lr_warmup_iters=-1", 8, "training.lr_warmup_iters=-1: must be >= 0"),
    ("lr_warmup_fraction=1.5", 8, "training.lr_warmup_fraction=1.5: must be in [0, 1]"),
    ("lr_decay_iters=0", 8, "training.lr_decay_iters=0: must be >= 1"),
    ("weight_decay=-0.1", 8, "training.weight_decay=-0.1: must be >= 0"),
    ("adam_beta1=1.0", 8, "training.adam_beta1=1.0: must be in [0, 1)"),
    ("adam_beta2=-0.5", 8, "training.adam_beta2=-0.5: must be in [0, 1)"),
    ("adam_eps=-1e-8", 8, "training.adam_eps=-1e-08: must be >= 0"),
    ("clip_grad=-1", 8, "training.clip_grad=-1.0: must be >= 0 (0: no clipping)"),
    ("seed=-1", 8, "training.seed=-1: must be >= 0"),
    ("eval_interval=-5", 8, "training.eval_interval=-5: must be >= 0"),
    ("eval_iters=-1", 8, "training.eval_iters=-1: must be >= 0"),
    ("save_interval=-1", 8, "checkpoint.save_interval=-1: must be >= 0"),
    ("max_documents=0", 8, "data.max_documents=0: must be >= 1"),
    ("lr_decay_style=bogus", 8, "training.lr_decay_style='bogus': must be one of constant, linear, cosine"),
    ("init_method_std=-1", 8, "model.init_method_std=-1.0: must be >= 0"),
    ("hidden_dropout=1.5", 8, "model.hidden_dropout=1.5: must be a probability, in [0, 1]"),
    ("attention_dropout=-0.1", 8, "model.attention_dropout=-0.1: must be a probability, in [0, 1]"),
    ("eval_fraction=1.5", 8, "data.eval_fraction=1.5: must be a share of the documents, in [0, 1)"),
    ("split=abc", 8, "data.split='abc': give comma-separated proportions"),
    ("split=1,2,3,4", 8, "data.split='1,2,3,4': give up to three non-negative proportions"),
    ("norm_epsilon=-1", 8, "model.norm_epsilon=-1.0: must be > 0"),
    ("rotary_base=0", 8, "model.rotary_base=0.0: must be > 0"),
    # a float no rule names is still finite (inf passed every `> 0` rule)
    ("rotary_base=inf", 8, "model.rotary_base=inf: must be a finite number (fix: rotary_base=10000.0)"),
    ("norm_epsilon=inf", 8, "model.norm_epsilon=inf: must be a finite number"),
    ("init_method_std=inf", 8, "model.init_method_std=inf: must be a finite number"),
    ("global_batch_size=12", 8, "micro_batch_size*DP = 1*8 = 8"),
    ("micro_batch_size=3 global_batch_size=16", 8, "micro_batch_size*DP = 3*8 = 24"),
    ("pipeline_schedule=zigzag", 8, "pipeline_schedule='zigzag': must be one of gpipe"),
    ("cp_comm_type=ring", 8, "cp_comm_type='ring': must be one of p2p"),
    ("normalization=ScaleNorm", 8, "normalization='ScaleNorm': must be one of RMSNorm, LayerNorm"),
    ("order=tp-cp-dp-pp", 8, "must order each of tp, cp, ep, dp, pp once"),
    ("recompute_granularity=partial", 8, "recompute_granularity='partial'"),
    ("pp=4 num_layers=8 decoder_first_pipeline_num_layers=3 decoder_last_pipeline_num_layers=2", 8,
     "3 layers remain for the 2 middle stage(s)"),
    ("decoder_first_pipeline_num_layers=1", 8, "need pipeline_model_parallel_size > 1"),
    ("pp=2 num_layers=4 pipeline_layers_per_stage=[1,2]", 8, "pipeline_layers_per_stage=[1, 2] must have"),
    ("pp=2 num_layers=3 account_for_embedding_in_pipeline_split=true account_for_loss_in_pipeline_split=true",
     8, "(num_layers=3 + 2 for embedding/loss = 5)"),
    ("num_experts=4 moe_router_topk=6", 8, "cannot route to more than num_experts=4"),
    # Megatron-LM's checks of the 1F1B all-to-all overlap
    ("num_experts=4 overlap_moe_expert_parallel_comm=true", 8, "needs expert parallelism (EP > 1)"),
    ("ep=2 num_experts=4 overlap_moe_expert_parallel_comm=true", 8, "a 16-bit model (precision=fp32"),
    ("ep=2 num_experts=4 precision=bf16 overlap_moe_expert_parallel_comm=true recompute_granularity=full "
     "recompute_method=uniform recompute_num_layers=1", 8, "no full recompute"),
    ("pp=2 ep=2 num_experts=4 precision=bf16 overlap_moe_expert_parallel_comm=true", 8,
     "interleaving under pipeline parallelism (PP=2)"),
    ("ep=2 num_experts=4 precision=bf16 overlap_moe_expert_parallel_comm=true moe_token_dispatcher_type=allgather", 8,
     "needs the alltoall or flex token dispatcher"),
    ("moe_token_dispatcher_type=deepep", 8, "moe_token_dispatcher_type='deepep': must be one of alltoall, allgather, flex"),
    ("tp=0", 8, "tensor_model_parallel_size=0: must be a whole number >= 1"),
    ("seq_length=0", 8, "seq_length=0: must be a whole number >= 1"),
    ("pp=2 num_layers=6 num_layers_per_virtual_pipeline_stage=2", 8, "multiple of PP*num_layers_per_virtual"),
    ("pp=2 num_layers=4 decoder_first_pipeline_num_layers=1 account_for_loss_in_pipeline_split=true", 8,
     "cannot be combined"),
    ("pp=2 num_layers=6 pipeline_schedule=dualpipev", 8, "pp*vpp=2*2=4"),
    ("pp=2 num_layers=4 vpp=2 decoder_first_pipeline_num_layers=1 decoder_last_pipeline_num_layers=3 "
     "global_batch_size=8", 8, "pipeline rank 0 holds 1 layers, not divisible by vpp=2"),
    # Megatron-Core's divide() asserts and bounds (issue 19)
    ("hidden_size=100 num_attention_heads=8", 8, "hidden_size must be a multiple of num_attention_heads=8"),
    ("tp=2 ffn_hidden_size=129 num_query_groups=2", 8, "the MLP width must divide evenly over tensor_model_"),
    ("tp=3 hidden_size=96 num_attention_heads=6", 6, "(unset: 8*hidden/3 rounded to 64 = 256)"),
    ("num_experts=4 moe_router_topk=0", 8, "moe_router_topk=0: must be >= 1"),
    ("tp=2 sp=true ep=2 num_experts=4 moe_ffn_hidden_size=33", 8, "routed experts' width must divide evenly"),
    ("vocab_size=0", 8, "model.vocab_size=0: must be a whole number >= 1"),
    ("make_vocab_size_divisible_by=0", 8, "make_vocab_size_divisible_by=0: must be a whole number >= 1"),
    ("pp=2 num_layers=4 decoder_first_pipeline_num_layers=0", 8, "decoder_first_pipeline_num_layers=0: must be >= 1"),
    ("pp=4 num_layers=8 decoder_first_pipeline_num_layers=8", 8, "0 layers remain for the 3 middle stage(s)"),
    ("qk_layernorm=true qk_layernorm_scope=model", 8, "qk_layernorm_scope='model': must be one of head, projection"),
    ("qk_layernorm=true qk_layernorm_scope=projection normalization=LayerNorm", 8,
     "q / k norms over the whole projection are OLMoE's RMSNorms over GQA's q and k, not built with "
     "normalization=LayerNorm"),
    ("qk_layernorm=true qk_layernorm_scope=projection multi_latent_attention=true", 8,
     "not built with multi_latent_attention"),
    # the router (Megatron's TransformerConfig checks, and group sizes its top-k fails or degenerates on)
    ("num_experts=8 moe_router_score_function=tanh", 8, "moe_router_score_function='tanh': must be one of softmax"),
    ("num_experts=8 moe_router_dtype=bf16", 8, "moe_router_dtype='bf16': must be one of None, fp32, fp64"),
    ("num_experts=8 moe_router_group_topk=2", 8, "needs the number of expert groups"),
    ("num_experts=8 moe_router_group_topk=1 moe_router_num_groups=3", 8, "num_experts=8 must split into"),
    ("num_experts=8 moe_router_group_topk=4 moe_router_num_groups=2", 8, "cannot choose more groups than"),
    ("num_experts=8 moe_router_topk=1 moe_router_group_topk=2 moe_router_num_groups=4", 8, "1//2 = 0 experts"),
    ("num_experts=8 moe_router_topk=4 moe_router_group_topk=1 moe_router_num_groups=4", 8,
     "the 1 chosen groups of 2 experts hold 2, fewer than moe_router_topk"),
    ("num_experts=8 moe_router_enable_expert_bias=true", 8, "the expert bias needs moe_router_score_function sigmoid"),
    ("num_experts=8 moe_router_score_function=sigmoid moe_router_bias_update_rate=-1e-3", 8,
     "moe_router_bias_update_rate=-0.001: must be >= 0"),
    ("num_experts=8 moe_router_topk_scaling_factor=0", 8, "moe_router_topk_scaling_factor=0.0: must be > 0"),
]


def _problems(words, world):
    loaded = load_config(None, words, world_size=world)
    with pytest.raises(ConfigError) as e:
        validate(loaded.config, loaded.dialect)
    return e.value


def test_table_is_large_and_messages_distinct():
    assert len(CASES) >= 30
    messages = [str(_problems(w.split(), n)) for w, n, _ in CASES]
    assert len(set(messages)) == len(messages)


@pytest.mark.parametrize("words, world, message", CASES, ids=[c[0] for c in CASES])
def test_refused_with_a_fix_that_validates(words, world, message):
    err = _problems(words.split(), world)
    assert message in str(err)
    for problem in err.problems:
        if problem.severity != "error":
            continue
        assert problem.fix != "none found", problem
        fix_words = [w.strip() for w in problem.fix.replace(", ", "|").split("|")]
        fixed = load_config(None, words.split() + fix_words, world_size=world)
        validate(fixed.config, fixed.dialect)  # raises if the fix does not validate


def test_a_world_size_no_layout_knob_fits_proposes_the_world_size():
    """The demo (TP2 with SP, 16 sequences in micro-batches of 2) started on 3 ranks: no TP, PP or CP
    alone divides 3 and keeps the rest valid (TP1 drops SP's premise), so the fix is a world size the
    layout divides (it said "fix: none found"); the world sizes tried are the layout's multiples."""
    from fivefold.config.fixes import candidates
    from fivefold.config.rules import sizes_of
    loaded = load_config("examples/demo.yaml", [], world_size=3)
    with pytest.raises(ConfigError, match=r"must divide the world size 3 \(fix: world_size=4\)"):
        validate(loaded.config, loaded.dialect)
    fixed = load_config("examples/demo.yaml", [], world_size=4)
    validate(fixed.config, fixed.dialect)
    assert candidates("world", {**sizes_of(loaded.config), "tp": 4, "world": 10}) == [8, 12, 4, 16]
    huge = 10**12  # by arithmetic: listing the multiples of 3 below it hung `validate tp=3 --world-size 10^12`
    assert candidates("world", {**sizes_of(loaded.config), "tp": 3, "world": huge}) == \
        [huge - 1, huge + 2, huge - 4, huge + 5]


def test_bf16_and_fp16_on_one_command_line_are_refused_as_megatron_asserts(tmp_path):
    """Megatron-LM asserts not --fp16 and --bf16 together (the later one won here, silently); a .txt
    file's precision may still be overridden by the command line after it."""
    with pytest.raises(UserError, match="the command line: --bf16 and --fp16 are both given"):
        load_config(None, ["--bf16", "--num-layers", "2", "--fp16"])
    line = tmp_path / "run.txt"
    line.write_text("--num-layers 2 --bf16 --fp16\n")
    with pytest.raises(UserError, match="run.txt: --bf16 and --fp16 are both given"):
        load_config(str(line))
    line.write_text("--num-layers 2 --bf16\n")
    assert load_config(str(line), ["--fp16"]).config.training.precision == "fp16"


def test_log_interval_must_be_positive():
    loaded = load_config("examples/demo.yaml", ["logging.log_interval=0"])
    with pytest.raises(ConfigError, match=r"logging.log_interval=0: must be a whole number >= 1.*log_interval=1"):
        validate(loaded.config, loaded.dialect)


def test_mla_has_no_kv_head_rule():
    """MLA's keys and values come from one latent shared by all heads: num_query_groups means nothing,
    so the GQA rule (KV heads vs TP) is not applied; the heads-over-TP rule still is."""
    words = "tp=4 num_attention_heads=12 num_query_groups=6".split()
    assert "KV heads must be divisible by TP=4" in str(_problems(words, 8))
    loaded = load_config(None, words + ["multi_latent_attention=true"], world_size=8)
    validate(loaded.config, loaded.dialect)


@pytest.mark.parametrize("words, said", [
    ("--train-iters 10 --train-samples 100", "training.train_iters and training.train_samples are both given"),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 5", "training.lr_warmup_fraction and training.lr_warmup_iters"),
    ("--train-samples 100 --lr-warmup-fraction 0.1 --lr-warmup-samples 5",
     "training.lr_warmup_fraction and training.lr_warmup_samples")])
def test_megatron_pairs_given_together_are_refused_as_megatron_asserts(words, said):
    """Megatron-LM asserts one of --train-iters / --train-samples and of --lr-warmup-fraction /
    --lr-warmup-iters (-samples); both were taken (the samples or the fraction silently won)."""
    with pytest.raises(UserError, match=said):
        load_config(None, words.split())
    load_config(None, words.split()[:-2])  # without the second of the pair: taken


def test_lr_decay_styles_megatron_has_but_the_runtime_does_not_are_not_implemented_yet():
    from fivefold.errors import NotImplementedYet
    from fivefold.config.supported import check_supported
    for style in ("WSD", "inverse-square-root"):
        loaded = load_config("examples/demo.yaml", [f"training.lr_decay_style={style}"])
        validate(loaded.config, loaded.dialect)  # Megatron's choices: valid
        with pytest.raises(NotImplementedYet, match="lr_decay_style"):
            check_supported(loaded.config)


@pytest.mark.parametrize("word, said", [
    ("model.lr=1e-4", "unknown config key 'model.lr' (did you mean training.lr?)"),
    ("model.seed=3", "unknown config key 'model.seed' (did you mean training.seed?)"),
    ("model.path=Qwen/Qwen2.5-0.5B", "model.path (SkyRL's Hugging Face model to train) is not read as a model here"),
])
def test_a_field_of_another_section_under_model_is_refused_not_moved_there(word, said):
    """Bridge and SkyRL keep the parallel knobs on the model config (model.tensor_model_parallel_size, read from
    Bridge's own table); any other field of another section under model. was moved there without a word
    (SkyRL's SFT `model.path=Qwen/...` became the training data path)."""
    with pytest.raises(UserError) as refused:
        load_config(None, [word])
    assert said in str(refused.value)
    assert load_config(None, ["model.tensor_model_parallel_size=2"]).config.parallel.tensor_model_parallel_size == 2
