"""What the activation count needs beyond ModelConfig: how many tensors the code that runs keeps.

Implementation traits (`ArchTraits`) say how many tensors the code that runs actually keeps where
Megatron's fused kernels keep fewer. Our eager CPU/GPU runtime (`EAGER_TRAITS`), checked against
torch's MemTracker on CPU (benchmarks/planner_vs_measured.py):
  - RMSNorm as separate ops saves its input x and the normalised x/rms(x) (for the gain's gradient),
    and the next linear saves the norm's output: 3 tensors of h per norm, not Megatron's 2;
  - SwiGLU as silu(g) * u saves g (for silu's backward), silu(g) and u (for the product's) and the
    product (down_proj's input): 4f, not the fused kernel's 3f;
  - the CPU flash kernel's output is already laid out (b, s, a, d), so o_proj's input is a view of
    the attention output: counted once, as here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.frozen import hashed_once


FP8_SCALE_BYTES = {"mxfp8": 1 / 32, "blockwise": 4 / 128}
"""Bytes of scale per fp8 value an activation carries beside its byte, by recipe: MXFP8 an e8m0 scale
per 32 values, blockwise an fp32 scale per 1 x 128 block (its weights' 128 x 128 blocks: ~0); one
scale per tensor (delayed, tensorwise): ~0."""


@hashed_once
@dataclass(frozen=True)
class ArchTraits:
    """What the activation count needs beyond ModelConfig (defaults: our Llama-style decoder)."""

    gated_mlp: bool = True
    """SwiGLU (saves gate and up outputs, 2f, and their product, f) vs GeLU (saves f and f)."""
    dropout: bool = False
    """Dropout after attention/MLP and on the attention probabilities (1-byte masks)."""
    flash_attention: bool = True
    """Fused attention: saves its output and fp32 log-sum-exp instead of the a*s*s scores."""
    bytes_per_value: int | None = None
    """Bytes of a saved activation; None = from the run's precision (`for_precision`): 4 for fp32,
    2 for bf16/fp16 and fp8 (fp8 GEMMs still save 16-bit tensors)."""
    norm_tensors: int = 2
    """h-wide tensors saved per pre-norm (its input + the next linear's input); 3 unfused (see above:
    x in fp32, 4 bytes a value also under 16-bit, where it is a copy, and x / rms(x) in the run's dtype)."""
    mlp_inner_tensors: int | None = None
    """f-wide tensors the MLP saves; None = 3 gated (gate, up, gate*up), 2 GeLU (pre, post)."""
    loss_bytes_per_logit: float | None = None
    """Bytes per (token, vocab entry) the output layer and loss hold at their peak; None = 2-byte-
    activation logits + the fp32 softmax a vocab-parallel cross entropy keeps (B + 4). Eager fp32
    F.cross_entropy: the saved log-softmax, its incoming gradient and the logits' gradient, 3 x 4 = 12
    (the logits themselves are freed once log_softmax has run)."""
    loss_transient_bytes: float = 0.0
    """Of `loss_bytes`, what only the loss being differentiated holds (eager: the log-softmax's incoming
    gradient and the logits' gradient, 8): with MTP's heads, each keeps the rest until its backward."""
    tp_loss_transient_bytes: float | None = None
    """`loss_transient_bytes` where TP splits the vocabulary and the loss is torch's DTensor loss_parallel
    run eagerly (torchtitan's before it compiled its loss): its decomposed log-softmax and backward hold
    two more fp32 copies at their peak, 16 bytes per local logit in all (measured on CPU, torch 2.13,
    against F.cross_entropy's 12); None = `loss_transient_bytes`."""
    vocab_parallel_keeps_logits: bool = False
    """Under TP the vocab-parallel loss (fivefold.parallel.tensor.cross_entropy) upcasts 16-bit logits to fp32
    while the 16-bit logits stay alive: their bytes per local logit more at the loss's peak
    (measured, TP2 SP bf16: the loss's peak 16-bit logits + fp32 copy + shifted + exp)."""
    optimizer_scratch_bytes: float = 0.0
    """Bytes per element of the rank's largest parameter counted in the gradient norm that clipping +
    the optimizer step allocate (fused/multi-tensor kernels: ~0). Eager: the fp64 copy and square in
    the norm, 16."""
    step_scratch_bytes: float = 0.0
    """The same for the optimizer step alone, what a parameter left out of the norm costs (a tied
    output layer's copy on the last pipeline stage). Eager per-tensor AdamW: the denominator's square
    root and quotient, 8 (measured: 16.25 MiB for a 2M-element piece)."""
    fsdp_root_whole: bool = False
    """ZeRO-3 without PP keeps the root unit (the embedding, final norm and output layer) and the last
    decoder layer gathered from the forward to their backward: torch's fully_shard does not reshard its
    root after forward, and torchtitan's apply_fsdp sets reshard_after_forward=False on the last layer
    (9dec370 and its June 2025 "default" policy); ours frees every unit after each use
    (fivefold.parallel.data.fsdp): False."""
    reduce_scatter_copy: bool = False
    """The backend's reduce-scatter holds a full-size copy of its input beside its output chunk until it
    completes (gloo: ProcessGroupGloo reduces a copy, then scatters); NCCL reduces in place: False."""
    flash_needs_equal_head_dims: bool = False
    """The fused attention kernel only takes q/k and v of one head dim, so where they differ (MLA:
    dn + dr != dv) the runtime zero-pads v to the q/k width (fivefold.ops.attention._widen) and slices
    the output back: the kernel keeps the padded v and its padded output, and the projection a copy
    of the slice (torch's CPU flash kernel under fivefold's eager runtime: True, measured)."""
    backward_inner_tensors: int = 0
    """f-wide temporaries one layer's backward holds at its peak, on top of the saved activations
    (the peak of a rank that holds no logits). Eager SwiGLU: dL/d(g*u), dL/du, dL/dsilu(g): 3
    (measured on CPU: +3 b s f x 4 bytes during a backward). Fused kernels: not modelled (0)."""

    fp8_linear_inputs: bool = False
    """Under fp8, each linear layer saves its input as the fp8 copy its GEMM read (1 byte), not the
    16-bit tensor (TransformerEngine's fp8 recipes); norms, attention and activation functions keep
    16-bit inputs. False: every saved tensor is 16-bit (torchao's Float8Linear, our runtime)."""
    linear_input_bytes: float | None = None
    """Bytes of a saved linear input; None = value_bytes (set by `for_precision`)."""
    fp8_weight_cache: bool = False
    """Under fp8, each decoder linear keeps the fp8 copies of its weight that its GEMMs read, from the
    step's first microbatch to its last (TransformerEngine's weight workspaces, which Megatron-Core
    keeps by passing is_first_microbatch: extensions/transformer_engine.py): the weight and its
    transpose (Hopper recipes) or its rowwise and columnwise MXFP8 copies (Blackwell), 2 bytes per
    element; 1 with fp8 primary weights (--fp8-param-gather: only the other usage is made). False:
    the casts are per GEMM (torchao's Float8Linear, our runtime)."""
    expert_outputs_saved: bool = True
    """The probability-weighted combine saves the experts' outputs (h per token copy) for the router
    weights' gradient. False: Megatron-Core's memory-efficient permutation applies the weights inside
    the expert, before the down-projection, to a tensor it keeps anyway (MCORE-MOE-2603: ~26 GB of
    DeepSeek-V3's activations at PP4 VPP4 EP64; the planner counts 29 GB)."""
    op_level_sac: bool = False
    """What selective recompute keeps. False: Megatron's --recompute-modules (`Sharding.modules`).
    True: torchtitan's op-level selective activation checkpointing: each block keeps its input, the
    attention kernel's outputs and every other matmul's output (`op_sac_saved`); the rest, routed
    experts included, reruns in backward."""
    weight_grad_copy: bool = False
    """A weight's gradient is made whole, then added into the buffer it accumulates in (eager autograd:
    True, measured: the output layer's, vocab x h, at the start of a zero-bubble W on the last rank).
    False: Megatron-Core's gradient-accumulation fusion writes the weight-gradient GEMM into main_grad."""

    def value_bytes(self) -> int:
        return self.bytes_per_value or 2

    def linear_bytes(self) -> float:
        return self.linear_input_bytes if self.linear_input_bytes is not None else self.value_bytes()

    def for_precision(self, precision: str, recipe: str = "delayed") -> ArchTraits:
        """These traits with bytes_per_value fixed by the run's precision where it was left None (an fp8
        linear input: 1 byte and its `recipe`'s scales)."""
        out = self
        if self.bytes_per_value is None:
            out = replace(out, bytes_per_value=4 if precision == "fp32" else 2)
        if self.fp8_linear_inputs and precision == "fp8" and self.linear_input_bytes is None:
            out = replace(out, linear_input_bytes=1 + FP8_SCALE_BYTES.get(recipe, 0.0))
        return out

    def loss_bytes(self) -> float:
        return self.loss_bytes_per_logit if self.loss_bytes_per_logit is not None else self.value_bytes() + 4


GPT3_TRAITS = ArchTraits(gated_mlp=False, dropout=True, flash_attention=False, bytes_per_value=2)
"""Korthikanti et al.'s GPT-3 setting."""

EAGER_TRAITS = ArchTraits(norm_tensors=3, mlp_inner_tensors=4, loss_bytes_per_logit=12.0, loss_transient_bytes=8.0,
                          optimizer_scratch_bytes=16.0, step_scratch_bytes=8.0, reduce_scatter_copy=True,
                          vocab_parallel_keeps_logits=True, weight_grad_copy=True,
                          flash_needs_equal_head_dims=True, backward_inner_tensors=3)
"""fivefold's own eager runtime in fp32 (unfused RMSNorm and SwiGLU, F.cross_entropy, per-tensor
AdamW, fp64 gradient norm), as measured on CPU."""
