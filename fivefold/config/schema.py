"""The one canonical config: typed, keyword-only dataclasses, one per owner.

Every dialect (RLinf YAML, SkyRL / Megatron-Bridge overrides, Megatron-LM flags, AReaL allocation
modes, our own YAML and dotted overrides) is translated into these objects; nothing downstream reads
a dialect. Field names follow Megatron-Core where Megatron has one, so that its users recognise them.
Each field's docstring (the string under it) gives its unit and default.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

from fivefold.errors import NotImplementedYet

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
DEVICES = ("auto", "cuda", "cpu")
"""cluster.device: where the ranks run (fivefold.runtime.mesh.resolve_device)."""
CP_COMM_SPELLINGS = {"all_gather": "allgather"}
"""TransformerEngine's and TransformerConfig's spelling -> ours (Megatron-LM's --cp-comm-type help)."""


def cp_comm_name(value) -> str:
    """A CP exchange as ours: TransformerEngine's spelling renamed; Megatron-Bridge's per-layer list
    taken when every layer has the same one (different exchanges per layer are not built), also as a
    command-line word "[all_gather,all_gather]"."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = value.strip().strip("[]").replace(",", " ").split()
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise NotImplementedYet(f"cp_comm_type {list(value)} (one exchange for every layer is built)")
        value = value[0]
    return CP_COMM_SPELLINGS.get(str(value), str(value))


DISPATCHERS = ("alltoall", "allgather", "flex")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
DROP_POLICIES = ("probs", "position")
QK_NORM_SCOPES = ("head", "projection")
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
ROUTER_DTYPES = (None, "fp32", "fp64")
DIM_NAMES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(kw_only=True)
class ClusterConfig:
    num_nodes: int = 1
    """Number of nodes. Default 1."""
    gpus_per_node: int = 8
    """Accelerators (or CPU ranks) per node. Default 8, as RLinf assumes."""
    world_size: int | None = None
    """Total ranks; default num_nodes * gpus_per_node when not given."""
    device: str = "auto"
    """Where the ranks run: cuda (NCCL, one GPU per rank on each node), cpu (gloo, one thread per rank),
    or auto: cuda where every rank on the node has a GPU of its own, else cpu with a notice (a 4-rank
    example on a 1-GPU machine runs on its CPU). Default auto."""

    @property
    def resolved_world_size(self) -> int:
        return self.world_size if self.world_size is not None else self.num_nodes * self.gpus_per_node


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP: ranks that split each weight matrix (heads, FFN, vocab). Default 1."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages (groups of layers on different ranks). Default 1."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP: model chunks per pipeline rank for the interleaved schedule. Default None (no interleaving)."""
    context_parallel_size: int = 1
    """CP: ranks that split the whole sequence (ring attention). Default 1."""
    cp_comm_type: str = "p2p"
    """CP attention communication: p2p (ring), a2a (all-to-all over heads), allgather (K and V gathered
    from the whole group before attention, exposed: Llama 3's; TransformerEngine's all_gather) or
    a2a+p2p. Default p2p."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """For cp_comm_type a2a+p2p: [a2a size, p2p size], product = CP. Default None."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split the MoE experts (folded into TP x CP x DP ranks). Default 1."""
    expert_tensor_parallel_size: int | None = None
    """ETP: TP inside each expert. Default None = TP (Megatron); AReaL's dialect sets 1."""
    sequence_parallel: bool = False
    """SP (Megatron's): shard norms/dropout/residual along the sequence in the TP group. Default False."""
    moe_token_dispatcher_type: str = "alltoall"
    """How the EP exchange is sent (Megatron's --moe-token-dispatcher-type): alltoall (a copy of each
    token per routed expert), allgather (the EP group's tokens gathered on every rank, the outputs
    reduce-scattered back), flex (DeepEP / HybridEP: a token once per node it is routed to, then over
    NVLink). The same sums: fivefold's runtime sends an all-to-all whatever this says; the planner
    times the one named for a runtime that has them (megatron-te). Default alltoall (Megatron-LM's,
    for a Megatron command line that leaves it out: allgather)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Megatron's 1F1B all-to-all overlap (--overlap-moe-expert-parallel-comm): one microbatch's EP
    dispatch / combine run beside another's compute. A schedule choice with the same sums: fivefold's
    runtime computes them without it; the planner times it for a runtime that has it (megatron-te).
    Megatron-LM's rules hold: EP > 1, the alltoall or flex dispatcher, no full recompute, VPP when
    PP > 1, at most one MTP layer, 16-bit. Default False."""
    tp_comm_overlap: bool = False
    """TP / SP communication overlapped with the GEMMs (Megatron's --tp-comm-overlap, TransformerEngine's
    userbuffers; torchtitan's async TP): a runtime switch with the same sums. fivefold's runtime computes
    them without it; the planner hides the runtime's share of the TP traffic where it is on
    (megatron-te, torchtitan). Megatron-LM's rule holds: sequence parallelism (so TP > 1). Default False."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying first. Default Megatron's tp-cp-ep-dp-pp."""
    pipeline_schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved, zb-h1 or dualpipev. Default 1f1b (interleaved when VPP is set)."""
    pipeline_schedule_csv: str | None = None
    """Path of a hand-written schedule in the IR's CSV form; overrides pipeline_schedule. Default None."""
    pipeline_layers_per_stage: list[int] | None = None
    """Explicit decoder layers per pipeline stage (sums to num_layers). Default None (even split)."""
    pipeline_model_parallel_layout: str | None = None
    """Megatron's --pipeline-model-parallel-layout: the virtual stages in model order, `|` between them, `E`
    the embedding (first stage), `t` a decoder layer, `m` an MTP layer (with `L`, the loss, in the last
    stage: our runtime runs MTP beside the loss), `X*n` / `(...)*n` repeats, e.g. `Et*3|(tt|)*5|tmL`.
    validate resolves it into pipeline_layers_per_stage and VPP = stages / PP. Default None."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage (Megatron's uneven split). Default None."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage (Megatron's uneven split). Default None."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer of the first stage when splitting. Default False."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer + loss as one layer of the last stage when splitting. Default False."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Megatron's way to ask for interleaving: layers per model chunk; VPP = num_layers / (PP x this).
    Default None (use virtual_pipeline_model_parallel_size)."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Interleaving runs the microbatches in groups of N: a group's forwards through chunk 0, then chunk
    1, ..., then the next group (Megatron's --microbatch-group-size-per-virtual-pipeline-stage; the
    Llama 3 paper's tunable N). PP <= N <= microbatches, and the last group (microbatches mod N) empty
    or at least PP: so N lets interleaving run a microbatch count that is not a multiple of PP (N =
    all of them is breadth-first). Rank r holds 2(PP - r - 1) + (VPP - 1) N + 1 chunk activations at
    its peak: a larger N holds more; the bubble is (PP - 1) / VPP whatever N. The same sums in any
    order. Default None = PP (depth-first); ignored without interleaving, as Megatron-LM does."""


@dataclass(kw_only=True)
class ModelConfig:
    num_layers: int = 2
    """Decoder layers. Default 2."""
    hidden_size: int = 64
    """Residual stream width h. Default 64."""
    ffn_hidden_size: int | None = None
    """Dense MLP width (SwiGLU inner size). Default None = 4h (rounded as Llama: 8h/3 to 64)."""
    num_attention_heads: int = 4
    """Query heads a. Default 4."""
    num_query_groups: int | None = None
    """KV heads (grouped-query attention). Default None = num_attention_heads (MHA)."""
    kv_channels: int | None = None
    """head_dim, independent of hidden/heads. Default None = hidden_size / num_attention_heads."""
    vocab_size: int = 256
    """Tokenizer vocabulary (before padding). Default 256 (the byte tokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """Padded vocabulary is a multiple of this x TP (Megatron). Default 128."""
    max_position_embeddings: int = 4096
    """Longest sequence RoPE is set up for, in tokens. Default 4096."""
    normalization: str = "RMSNorm"
    """RMSNorm or LayerNorm (Megatron's --normalization). Default RMSNorm."""
    norm_epsilon: float = 1e-5
    """Norm epsilon. Default 1e-5."""
    rotary_base: float = 10000.0
    """RoPE theta. Default 10000."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer. Default False (Megatron's untied)."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation. Default 0.02."""
    activation: str = "swiglu"
    """Dense MLP: swiglu (gate/up/down) or gelu (fc1 -> exact GeLU -> fc2, Megatron's default MLP
    without --swiglu; ffn_hidden_size then defaults to 4h). Default swiglu."""
    add_bias_linear: bool = False
    """Biases on QKV, attention output, MLP in and out (Megatron's default; --disable-bias-linear
    turns them off). Default False."""
    position_embedding_type: str = "rope"
    """rope, learned_absolute (a table of max_position_embeddings rows added to the token embedding,
    Megatron's default) or none. Default rope."""
    apply_layernorm_1p: bool = False
    """LayerNorm gain stored as g with weight 1 + g, g initialised to 0 (--apply-layernorm-1p).
    Default False."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (Megatron's default 0.1). Default 0."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before each residual add (Megatron's default 0.1).
    Default 0."""
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight).
    add_qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; Megatron's --add-qkv-bias). Default False."""
    qk_layernorm: bool = False
    """Normalise queries and keys before RoPE (per head: Qwen3, Megatron's --qk-layernorm; over the whole
    projection: OLMoE, see qk_layernorm_scope); with multi_latent_attention: the RMSNorms of the query and
    KV latents (DeepSeek's q_a_layernorm / kv_a_layernorm, which Megatron builds only with
    --qk-layernorm). Default False."""
    qk_layernorm_scope: str = "head"
    """What qk_layernorm's q / k norms (GQA) normalise over, per token: head (each head's head_dim
    features, gains of head_dim; Qwen3, Megatron) or projection (all a*head_dim query and g*head_dim key
    features, before the split into heads, gains of that width; OLMoE; RMSNorm only, not with MLA; under
    TP the sum of squares is all-reduced over TP). Default head."""
    multi_latent_attention: bool = False
    """MLA instead of GQA. Default False."""
    q_lora_rank: int | None = None
    """MLA query compression rank; None = uncompressed queries. Default None."""
    kv_lora_rank: int = 512
    """MLA key/value compression rank. Default 512."""
    qk_head_dim: int = 128
    """MLA per-head q/k width without RoPE. Default 128."""
    qk_pos_emb_head_dim: int = 64
    """MLA per-head decoupled RoPE width. Default 64."""
    v_head_dim: int = 128
    """MLA per-head value width. Default 128."""
    # Mixture of Experts.
    num_experts: int | None = None
    """Routed experts per MoE layer; None = dense model. Default None."""
    moe_router_topk: int = 2
    """Experts each token is routed to. Default 2."""
    moe_router_score_function: str = "softmax"
    """Router scores of the logits z: softmax, sigmoid, or sqrtsoftplus (sqrt(softplus(z))).
    Default softmax."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss, seq_aux_loss, sinkhorn or none. Default aux_loss."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient. Default 0."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss coefficient; None = off. Default None."""
    moe_expert_capacity_factor: float | None = None
    """Token dropping: each expert takes at most ceil(k n / E x factor) of the n tokens one router call
    sees (Megatron-Core's capacity: a rank's tokens of one micro-batch), the rest of its assignments
    are dropped (those tokens keep their other experts and the residual); None = dropless. Default None."""
    moe_token_drop_policy: str = "probs"
    """Which assignments an over-full expert keeps: probs (the highest routing weights) or position
    (the earliest tokens, sequence position first, as Megatron's [s, b] order). Default probs."""
    moe_grouped_gemm: bool | None = None
    """All local experts in one grouped matmul per projection (torch._grouped_mm) instead of one matmul
    per expert, the same math (--moe-grouped-gemm). None: chosen per device, grouped on CUDA, the loop
    on CPU (measured faster there with one thread). Default None."""
    moe_pad_expert_input_to_capacity: bool = False
    """Every expert computes exactly its capacity of rows (zero rows fill it; static shapes, all-to-all
    splits known in advance), the same math. Needs moe_expert_capacity_factor. Default False."""
    moe_ffn_hidden_size: int | None = None
    """Routed expert FFN width. Default None = ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total width of the shared experts; None = no shared expert. Default None."""
    moe_first_k_dense_layers: int = 0
    """Leading layers that keep a dense MLP (DeepSeek's first_k_dense_replace). Default 0."""
    mtp_num_layers: int | None = None
    """Multi-token prediction depths (DeepSeek-V3's MTP modules, Megatron --mtp-num-layers): module k
    predicts token t+k+1 from the previous depth's hidden state and the embedding of token t+k, with
    one transformer layer of the model's last layer's kind, on the last pipeline stage; None = off.
    Default None."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss (the mean over depths) added to the LM loss for the gradient; the
    reported loss stays the LM loss. Default 0.1 (Megatron's)."""
    moe_router_pre_softmax: bool = False
    """Top-k routing weights as the scores are (softmax over all experts, then top-k; Megatron
    --moe-router-pre-softmax, HF norm_topk_prob=False); False renormalises the top-k weights to sum
    1 (Mixtral, Megatron's default). With sigmoid / sqrtsoftplus scores True keeps them unnormalised
    (HF DeepSeek-V3's norm_topk_prob=False; a Megatron command line cannot say this: Megatron-LM
    renormalises those whatever the flag, and its dialect drops it). Default False."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the top-k weights (DeepSeek-V3's routed_scaling_factor); None = 1. Default None."""
    moe_router_dtype: str | None = None
    """fp32 or fp64: the router's linear, scores, top-k weights and the weighted sum of the experts'
    outputs in that dtype; None = the linear in the parameters' dtype, scores in fp32, the weighted
    sum in the parameters' dtype (Megatron's unset). Default None."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: experts split into this many equal groups (DeepSeek-V3's n_group);
    only with moe_router_group_topk. Default None."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: each token's experts come from its best this-many groups (a group
    scores the sum of its top k/group_topk scores); None = no group limit. Default None."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3's e_score_correction_bias): a per-expert bias added to
    the scores for the top-k choice only, updated after every step from the step's load. Default False."""
    moe_router_bias_update_rate: float = 1e-3
    """Expert bias step per optimizer step: bias_e += rate * sign(mean load - load_e). Default 1e-3."""
    moe_router_force_load_balancing: bool = False
    """Route by random normal logits (the router's gradient passes straight through): balanced
    load whatever the weights, for benchmarks. Default False."""

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the dense MLP: 3 for SwiGLU (gate, up, down), 2 for GeLU (fc1, fc2)."""
        return 3 if self.activation == "swiglu" else 2

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return 4 * self.hidden_size if self.activation == "gelu" else default_ffn_size(self.hidden_size)

    def padded_vocab_size(self, tp: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def default_ffn_size(hidden_size: int) -> int:
    """The SwiGLU width when ffn_hidden_size is unset: 8h/3 rounded up to a multiple of 64 (Llama)."""
    return ((8 * hidden_size // 3) + 63) // 64 * 64


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


@dataclass(kw_only=True)
class DataConfig:
    path: str | None = None
    """A text file, a folder of files, a .jsonl, a token file (.bin/.npy), a Megatron indexed dataset's
    prefix (PREFIX.bin + PREFIX.idx), or a blend `0.3 PREFIX_A 0.7 PREFIX_B` (a YAML list is joined);
    None = Python's stdlib sources."""
    format: str = "auto"
    """auto, text, jsonl, tokens or indexed. Default auto (from the path)."""
    mock_data: bool = False
    """Megatron's --mock-data: megatron-core's mock corpus (seeded random-length sequences of
    1, 2, ... mod vocab, each ending in the end-of-document id) instead of data.path. Default False."""
    split: str | None = None
    """Indexed datasets and mock data: Megatron's --split (train, validation, test proportions by sequence, e.g.
    969,30,1); None = 1 - eval_fraction, eval_fraction, 0. Default None."""
    tokenizer_type: str | None = None
    """Megatron's --tokenizer-type: HuggingFaceTokenizer (data.tokenizer = its local folder),
    GPT2BPETokenizer (vocab_file + merge_file; what a Megatron line with --vocab-file means when it names
    no type, as pretrain_gpt.py's default), NullTokenizer (ids below model.vocab_size, which then grows
    by one for the end-of-document id, as Megatron's); None = from data.tokenizer. Default None."""
    vocab_file: str | None = None
    """GPT-2's vocab.json for GPT2BPETokenizer (Megatron's --vocab-file). Default None."""
    merge_file: str | None = None
    """GPT-2's merges.txt for GPT2BPETokenizer (Megatron's --merge-file). Default None."""
    jsonl_field: str = "text"
    """The JSONL field holding the text. Default text."""
    token_dtype: str = "uint16"
    """uint16 or uint32 for pre-tokenized token files. Default uint16."""
    tokenizer: str = "byte"
    """byte (no download), or a local HF tokenizer directory. Default byte."""
    packing: bool = True
    """Pack documents into fixed-length sequences with an end-of-document token. Default True."""
    eval_fraction: float = 0.05
    """Held-out share of documents for evaluation. Default 0.05."""
    max_documents: int | None = None
    """Cap on documents read (for quick runs). Default None."""
    reset_position_ids: bool = False
    """Packed sequences: RoPE positions restart at 0 after every end-of-document token (Megatron
    --reset-position-ids). Default False."""
    reset_attention_mask: bool = False
    """Packed sequences: each document attends only to itself, in every layout (Megatron
    --reset-attention-mask; fivefold.data.documents). Default False."""
    eod_mask_loss: bool = False
    """No loss on the prediction made at an end-of-document token (Megatron --eod-mask-loss); the loss
    is then the mean over the remaining target tokens. Default False."""


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = None
    """Folder to save into; None = OUT/checkpoints. Default None."""
    load: str | None = None
    """Checkpoint folder to resume from. Default None."""
    save_interval: int | None = None
    """Steps between saves; None = only at the end. Default None."""
    async_save: bool = False
    """Write checkpoints from a background thread while training goes on (Megatron's --async-save;
    fivefold.checkpoint.async_save): committed at the next save or the end. Default False."""
    load_hf: str | None = None
    """A Hugging Face folder (config.json + safetensors) to start from, in any layout: weights only, a
    fresh optimizer at step 0 (Megatron's --finetune); the model section is read from its config.json.
    Default None."""
    save_hf: str | None = None
    """Also write the final model here as a Hugging Face folder (fivefold.hf.export). Default None."""
    exit_on_missing_checkpoint: bool = True
    """With `load`: a folder holding no checkpoint stops the run (UserError); False starts from step 0
    with a warning, as Megatron-LM does without --exit-on-missing-checkpoint (its scripts pass the save
    folder as --load to resume when there is something to resume). Megatron dialect default False.
    Default True."""
    finetune: bool = False
    """With `load`: the weights only — step 0, a fresh optimizer, no RNG state (Megatron's --finetune).
    Default False."""
    load_optim: bool = True
    """With `load`: also restore the optimizer (AdamW moments, fp32 main parameters, the loss scale);
    False (Megatron's --no-load-optim) starts AdamW fresh from the loaded weights at the saved step.
    Default True."""
    load_rng: bool = True
    """With `load`: also restore each rank's torch RNG state (same world size); False = Megatron's
    --no-load-rng. Dropout masks do not use it (fivefold.model.dropout). Default True."""


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 1
    """Steps between metric lines. Default 1."""
    tensorboard: bool = True
    """Write TensorBoard logs when the package is installed. Default True."""
    tensorboard_dir: str | None = None
    """Where TensorBoard logs go (Megatron's --tensorboard-dir). Default None = OUT/tensorboard."""
    wandb_project: str | None = None
    """Also log to Weights & Biases, offline (files under OUT/wandb; `wandb sync` uploads them), in this
    project (--wandb-project). Needs the wandb package. Default None = off."""
    wandb_exp_name: str | None = None
    """The W&B run name (--wandb-exp-name). Default None = W&B's own."""
    profile: bool = False
    """Profile the first iterations (Megatron --profile). Default False."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks to profile. Default [0]."""
    trace_schedule: bool = False
    """With PP > 1: time every pipeline action of the last step and draw it (OUT/schedule_trace.png)
    as `fivefold schedule` draws a simulated one. Default False."""
    moe_per_layer_logging: bool = False
    """MoE: also log each MoE layer's tokens per expert, load imbalance, aux loss (and dropped fraction)
    per logged step, and draw OUT/expert_load.png at the end (--moe-per-layer-logging). Default False:
    the totals over layers only."""


@dataclass(kw_only=True)
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS = {name: type(section) for name, section in vars(Config()).items()}
"""Section name -> its dataclass."""


def config_from_dict(d: dict) -> Config:
    """The Config `to_dict` wrote (a run spec, a checkpoint's metadata)."""
    return Config(**{name: cls(**d.get(name, {})) for name, cls in SECTIONS.items()})


def to_dict(obj) -> dict:
    """Nested plain dict of a config (for YAML output and comparisons)."""
    if is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj
