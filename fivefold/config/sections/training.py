"""training: the step (sequence length, batch sizes, iterations, AdamW and its LR schedule, precision and loss
scaling, recompute / offload, ZeRO's distributed optimizer, seeds, evaluation, timeouts, GC), a section of
fivefold.config.schema.Config."""
from __future__ import annotations

from dataclasses import dataclass

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


@dataclass(kw_only=True)
class TrainingConfig:
    seq_length: int = 64
    """Tokens per sequence. Default 64."""
    global_batch_size: int | None = None
    """Sequences per optimizer step, over all DP ranks. Default None = micro_batch_size x DP (Megatron);
    validation writes the resolved number back."""
    exit_interval: int | None = None
    """Stop (after saving a checkpoint) once the step count is a multiple of this (Megatron's
    --exit-interval). Default None."""
    exit_duration_in_mins: float | None = None
    """Stop (after saving a checkpoint) at the first step that ends this many minutes after training
    started, on every rank at the same step (Megatron's --exit-duration-in-mins). Default None."""
    calculate_per_token_loss: bool = True
    """The loss is the per-token mean over the whole global batch (Megatron's --calculate-per-token-loss);
    False: Megatron's default, the mean over the global batch's microbatches of each microbatch's
    per-token mean (they differ when microbatches hold different numbers of target tokens: padded
    variable-length samples, --eod-mask-loss). Megatron dialect default False. Evaluation is per token
    either way. Default True."""
    step_batch_size_schedule: str | None = None
    """Megatron's --step-batch-size-schedule "0:16 2.4B:320 ...": the global batch grows with the tokens
    consumed (fivefold.config.batch_sizes); global_batch_size may not be given with it. Default None."""
    micro_batch_size: int = 1
    """Sequences per microbatch per DP rank. Default 1."""
    train_iters: int = 10
    """Optimizer steps. Default 10."""
    optimizer: str = "adamw"
    """adamw (or sgd). Default adamw."""
    lr: float = 1e-3
    """Peak learning rate. Default 1e-3."""
    min_lr: float = 0.0
    """Floor of the decay. Default 0."""
    train_samples: int | None = None
    """Megatron's --train-samples: train for this many samples (train_iters = train_samples // global batch)
    and run the schedule in samples. Default None (iterations)."""
    lr_decay_iters: int | None = None
    """Steps over which the LR decays to min_lr (Megatron's --lr-decay-iters). Default None = train_iters."""
    lr_decay_samples: int | None = None
    """The same in samples (--lr-decay-samples, with train_samples). Default None = train_samples."""
    lr_warmup_samples: int = 0
    """Warm-up in samples (--lr-warmup-samples, with train_samples). Default 0."""
    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of the decay span (--lr-warmup-fraction); overrides the other warm-ups.
    Default None."""
    lr_warmup_init: float = 0.0
    """The learning rate the warm-up starts from (Megatron's --lr-warmup-init). Default 0."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps. Default 0."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant after warm-up. Default cosine."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay. Default 0.01."""
    adam_beta1: float = 0.9
    """Default 0.9."""
    adam_beta2: float = 0.95
    """Default 0.95."""
    adam_eps: float = 1e-8
    """Default 1e-8."""
    clip_grad: float = 1.0
    """Global gradient-norm clip over all ranks and shards; 0 = off. Default 1.0."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 parameters (fp8 for the planner only); 16-bit runs keep fp32 main parameters
    and AdamW state in the optimizer (fivefold.config.precision). Default fp32."""
    grad_reduce_in_bf16: bool = False
    """bf16: accumulate and reduce gradients in bf16 instead of fp32 (--grad-reduce-in-bf16). Default False."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """fp16: accumulate and reduce gradients in fp32 instead of fp16 (Megatron's flag). Default False."""
    loss_scale: float | None = None
    """fp16: a static loss scale; None = dynamic scaling (--loss-scale). Default None."""
    initial_loss_scale: float = 2.0 ** 32
    """fp16 dynamic scaling: the first scale (--initial-loss-scale). Default 2^32."""
    min_loss_scale: float = 1.0
    """fp16 dynamic scaling: the floor of the scale (--min-loss-scale). Default 1."""
    loss_scale_window: int = 1000
    """fp16 dynamic scaling: clean steps before the scale doubles (--loss-scale-window). Default 1000."""
    hysteresis: int = 2
    """fp16 dynamic scaling: overflow steps tolerated before the scale halves (--hysteresis). Default 2."""
    use_precision_aware_optimizer: bool = False
    """The optimizer owns the main parameters' dtype and placement (Megatron's
    --use-precision-aware-optimizer; required by optimizer_cpu_offload). Default False."""
    exp_avg_dtype: str = "fp32"
    """AdamW's first moment: fp32, bf16, fp16 or fp8 (--exp-avg-dtype; other than fp32 needs
    use_precision_aware_optimizer; the planner counts it, the runtime keeps fp32). Default fp32."""
    exp_avg_sq_dtype: str = "fp32"
    """AdamW's second moment, as exp_avg_dtype (--exp-avg-sq-dtype). Default fp32."""
    main_params_dtype: str = "fp32"
    """The optimizer's main parameters: fp32 or fp16 (--main-params-dtype; fp16 needs
    use_precision_aware_optimizer; planner only). Default fp32."""
    fp8_param_gather: bool = False
    """fp8: the model keeps its primary weights in fp8 (1 byte) and all-gathers them so, the main
    parameters staying in the optimizer (--fp8-param-gather; planner only). Default False."""
    fp8_format: str | None = None
    """TransformerEngine's fp8 formats (Megatron's --fp8-format, TransformerConfig.fp8): e4m3 or hybrid
    (e4m3 forward, e5m2 gradients); setting it makes the precision fp8 (planner only). Default None."""
    fp8_recipe: str = "delayed"
    """fp8 scaling (--fp8-recipe): delayed or tensorwise (a scale per tensor), blockwise (1x128 and
    128x128 blocks, Hopper), mxfp8 (a scale per 32 values, Blackwell's tensor cores only); read under
    fp8 only (planner only). Default delayed, Megatron's."""
    optimizer_cpu_offload: bool = False
    """Keep (a share of) the fp32 main parameters and AdamW state in host memory and step them there
    (--optimizer-cpu-offload). Default False."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the share of the optimizer's parameters offloaded
    (--optimizer-offload-fraction). Default 1.0."""
    recompute_granularity: str | None = None
    """None, selective or full activation recompute. Default None."""
    recompute_method: str | None = None
    """With full recompute: uniform or block. Default None."""
    recompute_modules: list[str] | None = None
    """With selective recompute: which parts are recomputed in backward (Megatron's --recompute-modules:
    core_attn, mla_up_proj, layernorm, mlp, moe_act, moe, shared_experts); None = core_attn. The
    planner models every module; the runtime recomputes core_attn only (others: not implemented yet)."""
    fine_grained_activation_offloading: bool = False
    """Move the inputs of `offload_modules` to host memory after their forward and back before their
    backward (Megatron's --fine-grained-activation-offloading; the planner models it, the runtime does
    not run it yet). Default False."""
    offload_modules: list[str] | None = None
    """With fine_grained_activation_offloading: the modules whose input is offloaded (--offload-modules:
    attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act). Default None."""
    recompute_num_layers: int | None = None
    """With full recompute: layers per chunk (uniform) or recomputed layers per stage (block)."""
    compile: bool = False
    """torch.compile each decoder layer (torchtitan's per-block compile; --compile). Default False."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (ZeRO-1). Default False."""
    data_parallel_sharding_strategy: str | None = None
    """no_shard, optim (ZeRO-1), optim_grads (ZeRO-2) or optim_grads_params (ZeRO-3), Megatron-FSDP's
    --data-parallel-sharding-strategy; None = from use_distributed_optimizer. Default None."""
    num_distributed_optimizer_instances: int = 1
    """HSDP: the DP x CP group split into this many instances; gradients, optimizer state (and ZeRO-3
    parameters) sharded within an instance, replicated across them, the reduced chunks all-reduced
    between instances (Megatron's --num-distributed-optimizer-instances; torchtitan's dp_replicate x
    dp_shard). Default 1."""
    use_megatron_fsdp: bool = False
    """Megatron's --use-megatron-fsdp: the switch under which Megatron reads the sharding strategy
    (accepted; the strategy field decides here). Default False."""

    @property
    def sharding_strategy(self) -> str:
        """The data-parallel mode this config trains with (fivefold.parallel.data.data_parallel.DPMode)."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"
    seed: int = 1234
    """Seed for initialisation and data order. Default 1234."""
    eval_interval: int | None = None
    """Steps between evaluations; None or 0 = no evaluation. Default None."""
    eval_iters: int = 2
    """Batches per evaluation; 0 = no evaluation (as Megatron's --eval-iters 0). Default 2."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run on every rank at the first step whose loss or gradient norm is NaN or infinite,
    before that step's checkpoint (Megatron's --[no-]check-for-nan-in-loss-and-grad). Default True."""
    distributed_timeout_minutes: float = 10.0
    """A rank that waits in one collective, or stops running, this long ends the job with a message
    naming it (Megatron's --distributed-timeout-minutes). Default 10."""
    distributed_timeout_seconds: float | None = None
    """The same timeout in seconds (fivefold's, for short jobs and tests); wins over the minutes when
    set. Default None."""
    manual_gc: bool = False
    """Python's threshold-based garbage collector off while training, one full collection at its start
    (Megatron's --manual-gc: a collection pausing one rank in the middle of a step delays every rank;
    fivefold.train.manual_gc). Default False."""
    manual_gc_interval: int = 0
    """With manual_gc: a full collection after every this many steps; 0 = none between steps (Megatron's
    --manual-gc-interval). Default 0."""
    manual_gc_eval: bool = True
    """With manual_gc: a full collection before each evaluation and a young-generation one after it
    (Megatron's default; --no-manual-gc-eval turns it off). Default True."""
