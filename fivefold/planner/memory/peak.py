"""Memory per GPU, by kind, for every pipeline rank; the worst rank is what must fit: the model
state (`states.py`) plus the activations of the microbatches in flight and the fixed terms.

Activations: `activations.py` per microbatch, times the microbatches the schedule keeps in flight
on that rank (`../pipeline.py`); with full recompute, plus one layer's full activations during its
backward (not at the forward peak on the last rank: the loss runs before any layer is rebuilt).
Fixed terms: on the last rank, the final norm's saved tensors and one microbatch of logits
(bf16) and the fp32 softmax the vocab-parallel cross entropy keeps (`ArchTraits.loss_bytes_per_logit`: eager fp32 keeps 12 bytes per
logit), and what each further loss-stage microbatch whose backward has not run keeps (the saved
softmax and norm tensors; GPipe all m, an interleaved schedule's short last group of microbatches
several: `PipelineProfile.moments`' final count; measured, GPipe PP2's last rank 0.881 -> 1.002);
communication buffers (PP send/recv, the SP all-gather output of
one layer, EP dispatch/combine buffers, expert TP's gathered rows and their partial outputs), in use
at a layer's moments, not at the last rank's loss (measured: the last stages 1.002-1.034 when they were).
Eager autograd (`ArchTraits.weight_grad_copy`): the heads' backward on the last rank, where each
head's output-layer gradient and each MTP depth's embedding gradient wait whole in autograd's input
buffers to be summed (`_Ranks._heads_backward`; at few tokens per rank the step's peak).
Optimizer scratch: clipping and the optimizer step run after backward has freed the activations,
so their temporaries (`ArchTraits.optimizer_scratch_bytes` per element of the rank's largest tensor
stepped, a ZeRO chunk's piece under a sharded mode: `largest_main`), and the moments at the end of
backward that hold little activation (gloo's reduce-scatter copies, a tied embedding's gradients),
raise the peak only by what they exceed activations + logits + buffers by; that excess is the
"scratch" kind (0 for fused optimizers, and whenever activations dominate).
With --optimizer-cpu-offload, the offloaded share of the optimizer state (main parameters + AdamW
moments) is host memory and not counted; with --fine-grained-activation-offloading, so are the
offloaded module inputs of every microbatch in flight but the one being computed. Then a stated allocator overhead (share of all tensor
memory) and a runtime reserve (CUDA context + NCCL workspaces) that the allocator never sees.
"""
from __future__ import annotations

from typing import NamedTuple

from fivefold.config.precision import DEFAULT_BUCKET_BYTES, Precision
from fivefold.planner.memory.activations import Sharding
from fivefold.planner.layout import Plan
from fivefold.planner.memory.mtp import mtp_activation_values
from fivefold.planner.pipeline import Front, pipeline_profile
from fivefold.planner.memory.kinds import STEP_MARGIN, MemoryAssumptions, RankMemory
from fivefold.planner.memory.layers import _for_precision, _layers
from fivefold.planner.memory.states import (backward_buckets, expert_bucket, fp8_weight_cache, largest_main,
                                            model_state, optimizer_phase, rank_params, root_params,
                                            state_bytes_per_param, whole_for_step, zero3_units)


def memory_per_rank(plan: Plan, assume: MemoryAssumptions = MemoryAssumptions()) -> list[RankMemory]:
    ranks = _Ranks(plan, assume)
    return [ranks.memory(r) for r in range(plan.pp)]


class _Ranks:
    """What every pipeline rank of one plan shares; `memory(r)` sizes rank r."""

    def __init__(self, plan: Plan, assume: MemoryAssumptions):
        self.plan = plan
        self.sh = Sharding.of(tp=plan.tp, sp=plan.sp, cp=plan.cp, etp=plan.etp, recompute=plan.recompute,
                           modules=plan.recompute_modules)
        # under full recompute a zero-bubble B is the whole backward (fivefold.pipeline.executor): its
        # microbatch's activations are freed there, not at its W
        self.prof = pipeline_profile(plan.schedule, plan.pp, plan.vpp, plan.microbatches, plan.group,
                                     plan.recompute == "full")
        traits = _for_precision(assume.traits, plan.precision, plan.config.training.fp8_recipe)
        self.assume = MemoryAssumptions(allocator_overhead=assume.allocator_overhead,
                                        runtime_reserve=assume.runtime_reserve, traits=traits)
        # ranks of the same shape (layers by kind, ends) hold the same per-microbatch state
        self.shapes = plan.rank_shapes
        training = plan.config.training  # bytes per dense / expert parameter: the same on every rank
        self.state_bytes = (state_bytes_per_param(training, plan.precision, plan.dp * plan.cp),
                            state_bytes_per_param(training, plan.precision, plan.edp))
        self.prec = Precision.of(training, plan.precision)
        self.mode = training.sharding_strategy
        self.states: dict[int, _RankState] = plan.cached(
            ("rank states", plan.tp, plan.etp, plan.ep, plan.dp, plan.cp, plan.edp, plan.instances,
             plan.reduce_every_microbatch, plan.precision, self.prec, self.mode, traits, training.fp8_recipe,
             training.fp8_param_gather), dict)
        """Rank -> `state(rank)`, shared by the plans of this split with the same state key."""
        self._fixed()

    def _fixed(self) -> None:
        """The terms that do not depend on the rank: communication buffers; on the last rank the logits
        and the loss (and their W-pending gradient under zero-bubble schedules)."""
        plan, traits = self.plan, self.assume.traits
        m, B = plan.config.model, traits.value_bytes()
        tokens = plan.mbs * plan.seq / plan.cp
        sp_div = plan.tp if plan.sp else 1
        heads = 1 + (m.mtp_num_layers or 0)  # MTP: another output layer per depth (planner/memory/mtp.py)
        vocab = m.padded_vocab_size(plan.tp) / plan.tp
        self.head_params = vocab * m.hidden_size
        """The output layer's elements on one rank of the last pipeline rank (or, tied, the embedding's)."""
        # the logits and the loss's fp32 softmax (see ArchTraits.loss_bytes_per_logit), the final norm's
        # saved tensors (its input, the output layer's input; + x/rms(x) unfused), MTP's
        held = traits.loss_bytes() - traits.loss_transient_bytes  # what each head keeps until its backward
        logit_held, norm_held = tokens * vocab * held, traits.norm_tensors * tokens * m.hidden_size * B / sp_div
        side = mtp_activation_values(m) * tokens * B / sp_div
        self.loss_state = heads * (logit_held + norm_held) + side
        """What a microbatch keeps on the last rank from its loss-stage forward to its backward."""
        transient = traits.loss_transient_bytes
        if plan.tp > 1 and traits.tp_loss_transient_bytes is not None:
            transient = traits.tp_loss_transient_bytes
        elif plan.tp > 1 and traits.vocab_parallel_keeps_logits and B < 4:
            transient += B  # the 16-bit logits beside their fp32 copy (ArchTraits.vocab_parallel_keeps_logits)
        self.logits = self.loss_state + tokens * vocab * transient
        # the logits' gradient, the output layer's join and the loss's saved fp32 log-softmax, kept with
        # the graph until W (zero-bubble schedules); the vocab-parallel loss (TP) turns its saved fp32
        # softmax into the gradient in place, so in fp32 they are one tensor (measured, ZB-H1 x TP2 at
        # mbs2: 1.09 of the last stage when counted twice); each MTP depth's head again, and where its
        # branches meet the input path: eh_proj's input (the concatenation) and output, the hnorm and
        # final-norm gain products (measured, PP2 ZB-H1 MTP1 at mbs2: 0.796 without them)
        self.logit_joins = heads * tokens * vocab * (4 if plan.tp > 1 and B >= 4 else B + 4)
        self.logit_joins += (heads - 1) * tokens * m.hidden_size * B * (4 / sp_div + 1 / plan.tp)
        buffers = tokens * m.hidden_size * B * (4 / sp_div if plan.pp > 1 else 0)  # PP send/recv, fwd + bwd
        if plan.tp > 1:
            buffers += tokens * m.hidden_size * B  # one gathered (SP) or reduced (TP) layer input
        if m.is_moe and (plan.ep > 1 or plan.etp > 1):  # dispatch + combine (expert TP: gathered, reduced)
            buffers += 2 * m.moe_router_topk * tokens / plan.tp * plan.etp * m.hidden_size * B
        self.buffers = buffers
        # a head's loss differentiated: F.cross_entropy's two fp32 gradients; the vocab-parallel loss (TP)
        # turns its saved softmax into the gradient in place, cast to a 16-bit run's dtype
        differentiated = (B if B < 4 else 0) if plan.tp > 1 else traits.loss_transient_bytes
        self.heads_backward, self.waiting = self._heads_backward(logit_held, norm_held, side,
                                                                 tokens * vocab * differentiated)

    def _heads_backward(self, logit_held: float, norm_held: float, side: float, differentiated: float
                        ) -> tuple[float, float]:
        """(beyond the held layers but one MTP layer and one gradient bucket: the most the heads'
        backward holds, the elements of the gradient held through the decoder's backward) on the
        last rank, where a backward makes the weight gradients (eager, not zero-bubble: its W makes them,
        `w_start`). Each head makes the output layer's gradient whole, each MTP depth's lookup the
        embedding's, and autograd holds a parameter's gradient in its input buffer until its last use
        there is differentiated, summing out of place (buffer, new, sum: 3 at once). The heads run from
        the last depth down to the main one, each depth's lookup after its head. Two moments: a sum
        (tied, one parameter, also the last stage's embedding copy under PP: the last depth's lookup,
        every other head's loss not yet differentiated; untied: the next head's, beside the
        embedding's buffer while a lookup is still to come: the main one without PP, a shallower
        depth's) and the next head's loss differentiated (`differentiated` a head's transient bytes)
        beside the buffers. Without PP the embedding's lookup comes last, so with a tied output layer or
        MTP one gradient waits through the decoder's backward. Measured (PP1 seq64 mbs1, 8192 x 256 fp32:
        8 MiB each): MTP1 4 at a sum, tied 3 (the main loss's log-softmax beside it), MTP2 4 (one beside
        it), tied 3 (two); the next loss's moment: all-gather CP2 x DP2 ZeRO-2 bf16 MTP1 tied (0.907 when
        neither was counted)."""
        plan, traits, m = self.plan, self.assume.traits, self.plan.config.model
        if not traits.weight_grad_copy or self.prof.pending_weight_chunks[plan.last_rank]:
            return 0.0, 0.0
        depths, tied = m.mtp_num_layers or 0, m.tie_word_embeddings
        params = self.head_params
        grad = params * traits.value_bytes()
        # (ZeRO-3 reducing every microbatch counts the output layer's unit's gradient in its buckets)
        zero3 = self.mode == "optim_grads_params" and plan.reduce_every_microbatch
        waiting = params if plan.pp == 1 and (tied or depths) and not zero3 else 0.0
        if not depths:
            return 0.0, waiting
        lookup = not tied and (plan.pp == 1 or depths > 1)  # the embedding's buffer beside the heads'
        states = (depths - 1) * (logit_held + side / depths) + depths * norm_held
        summed = (logit_held + norm_held) * tied + (3 + lookup) * grad
        next_loss = logit_held + differentiated + (1 + lookup) * grad
        return states + max(summed, next_loss), waiting

    def sized(self) -> list[RankMemory]:
        """Every rank that can hold the most, sized, in rank order. A rank is left out when an earlier
        rank of its shape holds at least as many microbatches in flight and pending W at every moment
        (`coverers`): every term of the total is then no larger, also after float rounding. The
        optimizer's scratch is the exception: it shrinks as activations grow, so a rank under such
        traits is left out only where its coverer's activations exceed its optimizer step's peak by
        more than any rounding (`STEP_MARGIN`): the left-out rank's total, its activations' or its
        step's peak beside the same model state, is then below the coverer's."""
        scratch = self.assume.traits.optimizer_scratch_bytes
        out: list[RankMemory] = []
        sized: dict[int, RankMemory] = {}
        above: dict[int, bool] = {}  # coverer -> `_above_step` (a coverer covers many ranks)
        for r, by in enumerate(self.coverers()):
            if by is not None:
                if not scratch:
                    continue
                if by not in above:
                    above[by] = self._above_step(sized[by])
                if above[by]:
                    continue
            sized[r] = self.memory(r)
            out.append(sized[r])
        return out

    def _above_step(self, rm: RankMemory) -> bool:
        """Whether rank `rm.rank`'s activations exceed its optimizer step's peak by `STEP_MARGIN`."""
        held = rm.activations + rm.logits + rm.buffers
        return held - self.state(rm.rank).step_peak > STEP_MARGIN * rm.total

    def coverers(self) -> tuple[int | None, ...]:
        """Per rank, None where it can hold the most, else the earlier rank of its shape whose moments
        cover its own: every moment of this rank is matched or exceeded, in every count, by one of that
        rank's."""
        return self.plan.cached(("peak coverers", self.plan.microbatches), self._coverers)

    def _coverers(self) -> tuple[int | None, ...]:
        prof, out, best = self.prof, [], {}
        for r, shape in enumerate(self.shapes):
            moments = prof.moments[r]
            earlier = best.setdefault(shape, [])
            out.append(next((e for e, other in earlier if all(_covers(o, m) for o, m in zip(other, moments))), None))
            if out[-1] is None:
                earlier.append((r, moments))
        return tuple(out)

    def memory(self, r: int) -> RankMemory:
        plan, prof, assume = self.plan, self.prof, self.assume
        traits = assume.traits
        rm = RankMemory(rank=r)
        detail, per_mb, transient, joins, bwd, offloaded, last = _layers(plan, self.shapes[r][0], r, self.sh, traits,
                                                                          plan.cp_gathers_kv, prof.defers_weights)
        state = self.state(r)
        dense, expert = state.dense, state.expert
        rm.params, rm.weights, rm.grads, rm.optimizer = dense + expert, state.weights, state.grads, state.optimizer
        rm.detail = detail  # shared with the cache: read only
        rm.inflight = prof.inflight_microbatches(r)
        if r == plan.last_rank:
            rm.logits = self.logits
            joins += self.logit_joins
        w_start = 0.0  # what a W holds beyond the pending joins as it starts (none pend under full
        # recompute: the profile's B is then the whole backward)
        if traits.weight_grad_copy and r == plan.last_rank and prof.pending_weight_chunks[r]:
            # a zero-bubble W on the last rank starts with the output layer's weight gradient, beside
            # every pending join (measured, ZB-H1 x all-gather CP2 at mbs1: 0.939 without); with MTP
            # one per head, and one per depth of the embedding copy it embeds with, summed in one call
            # (measured, PP2 ZB-H1 MTP1: 3 of them)
            uses = 1 + 2 * (plan.config.model.mtp_num_layers or 0)
            w_start = uses * self.head_params * traits.value_bytes()
        # the peak is at a forward (the last rank's logits) or in a layer's backward (with the layer a
        # recompute rebuilt), each moment with the activations held and the zero-bubble schedules'
        # B-done-W-pending gradients (`PipelineProfile.moments`, in chunks); offloaded inputs stay
        # on the device only for the microbatch being computed
        forward, backward = prof.moments[r]
        at_forward = _held(forward, prof.vpp, per_mb, offloaded, joins, self.loss_state, 1)
        in_backward = held = _held(backward, prof.vpp, per_mb, offloaded, joins, self.loss_state, 0)
        heads = held - last + self.heads_backward if r == plan.last_rank and self.heads_backward else 0.0
        waiting = self.waiting if r == plan.last_rank else 0.0
        if self.mode in ("optim_grads", "optim_grads_params"):  # (a call the search's ZeRO-1 layouts skip)
            # the waiting gradient's parameter, the first, is in the last bucket: not filled before
            # it unless that is the only one (measured, DP2 ZeRO-2 tied: 1.056 when counted in both)
            apart = waiting if dense * self.prec.state_bytes(1, "no_shard")[0] > DEFAULT_BUCKET_BYTES else 0.0
            in_backward += backward_buckets(plan, r, dense - apart, self.prec, self.mode, expert)
            if heads:  # MTP's layer made the first bucket's gradients, none is in flight yet
                heads += backward_buckets(plan, r, dense - apart, self.prec, self.mode, expert, filling=True)
        head = 0.0
        if r == plan.last_rank and self.mode == "optim_grads_params" and plan.reduce_every_microbatch:
            # the output layer's backward, the loss's tensors freed: its unit gathered again, its weight
            # gradient computed beside the bucket it is added into, the next unit prefetched (measured,
            # all-gather CP2 x DP2 fp32 ZeRO-3 at mbs1: the peak, 0.935 when it was not counted)
            layer, end, _ = zero3_units(plan, r)
            weight, grad, _ = self.prec.state_bytes(1, "no_shard")
            gathered = 0.0 if traits.fsdp_root_whole else end + layer  # FSDP2's root and last layer: whole already
            head = at_forward + end * 2 * grad + gathered * weight
        # each moment with the communication buffers in use then: none at the loss on the last rank
        # (measured: the last stages of the PP rows were 1.002-1.034 with a layer's buffers counted there)
        at_loss = max(at_forward + rm.logits, heads)  # the heads' backward: a moment without buffers too
        in_layer = max(head, in_backward + bwd + transient + waiting * traits.value_bytes(), in_backward + w_start)
        rm.buffers = self.buffers
        if r == plan.last_rank and at_loss > in_layer + rm.buffers:
            rm.buffers, in_layer = 0.0, at_loss
        rm.activations = max(at_loss, in_layer) - rm.logits
        rm.scratch = max(0.0, state.step_peak - (rm.activations + rm.logits + rm.buffers))
        tensors = rm.weights + rm.grads + rm.optimizer + rm.activations + rm.logits + rm.buffers + rm.scratch
        rm.overhead = assume.allocator_overhead * tensors
        rm.reserve = assume.runtime_reserve
        return rm

    def state(self, r: int) -> "_RankState":
        """Rank r's model state and optimizer step, kept with the layer split (`Plan.cached`) under
        everything else they read, by rank: the search sizes each rank under several micro-batches,
        recompute modes and CP exchanges of one layout, and one split under many layouts."""
        got = self.states.get(r)
        if got is None:
            got = self.states[r] = self._state(r)
        return got

    def _state(self, r: int) -> "_RankState":
        plan, traits = self.plan, self.assume.traits
        dense, expert = rank_params(plan, r)
        weights, grads, optimizer = model_state(plan, r, dense, expert, self.state_bytes, self.prec, self.mode)
        if traits.fp8_weight_cache and plan.precision == "fp8":
            weights += fp8_weight_cache(plan, r)
        if traits.fsdp_root_whole and self.mode == "optim_grads_params" and plan.reduce_every_microbatch:
            weights += root_params(plan, r) * self.prec.state_bytes(1, "no_shard")[0]
        largest = (largest_main(plan, r, self.prec.state_bytes(1, "no_shard")[0])
                   if traits.optimizer_scratch_bytes else (0.0, 0.0))  # read only with scratch
        released = whole_for_step(plan, r, dense + expert, self.prec, self.mode)
        units = (0.0, 0.0)
        if traits.reduce_scatter_copy and self.mode != "no_shard":  # the buckets: ZeRO-3's units, the experts'
            layer, end, _ = zero3_units(plan, r)
            units = (max(layer, end) if self.mode == "optim_grads_params" else 0.0,
                     expert_bucket(plan, r, self.prec.state_bytes(1, "no_shard")[0]))
        phase = optimizer_phase(plan, dense, expert, largest, traits, self.prec, released, units)
        return _RankState(dense, expert, weights, grads, optimizer, max(phase, self.tied_embedding_backward(r)))

    def tied_embedding_backward(self, r: int) -> float:
        """Bytes beyond the model state at the embedding's backward, the end of backward on a rank
        whose tied embedding is also its output layer (without PP: one parameter): autograd adds the output
        layer's weight gradient, held since the start of backward, to the embedding's before either
        reaches the parameter, all three whole; ZeRO-3 reducing every microbatch has the unit gathered
        again and the last layer's bucket in flight (measured, CP2 x DP2 fp32 ZeRO-3 with full
        recompute at mbs1: the peak, 0.886 when it was not counted)."""
        plan, m = self.plan, self.plan.config.model
        if not (m.tie_word_embeddings and plan.pp == 1):
            return 0.0
        weight, grad, _ = self.prec.state_bytes(1, "no_shard")
        held = 3 * self.head_params * weight
        if self.mode == "optim_grads_params" and plan.reduce_every_microbatch:
            layer, end, _ = zero3_units(plan, r)
            held += end * weight + layer * grad * (1 + 1 / (plan.dp * plan.cp))
        return held


class _RankState(NamedTuple):
    """What a pipeline rank holds whatever its activations (`_Ranks.state`): its dense and expert
    parameters, their weights', gradients' and optimizer's bytes, and the most its optimizer step holds
    beyond them (the step's temporaries or gathers, or a tied embedding's backward)."""
    dense: float
    expert: float
    weights: float
    grads: float
    optimizer: float
    step_peak: float


def _held(front: Front, v: int, per_mb: float, offloaded: float, joins: float, loss_state: float,
          counted: int) -> float:
    """The most a moment of `front` holds, its (held, pending, final) counts (chunks, `v` a
    microbatch): the held activations, less the offloaded inputs of all but one microbatch, plus the
    pending ones' gradients and the loss state of the loss-stage microbatches held beyond the
    `counted` ones the rank's logits term has (the running forward's)."""
    best = None
    for h, p, f in front:
        x = h / v
        held = per_mb * x + joins * p / v + loss_state * max(0, f - counted)
        if offloaded and x > 1:
            held -= offloaded * (x - 1)
        if best is None or held > best:
            best = held
    return best


def _covers(a: Front, b: Front) -> bool:
    """Every moment of `b` is matched or exceeded, in every count, by one of `a`."""
    return all(any(h >= x and p >= y and f >= z for h, p, f in a) for x, y, z in b)


def peak_memory(plan: Plan, assume: MemoryAssumptions = MemoryAssumptions()) -> RankMemory:
    """The pipeline rank with the largest total (the first such rank, as max over `memory_per_rank`).
    The CP exchange is read only as whether it gathers K and V (`Plan.cp_gathers_kv`): a layout's p2p
    and a2a twins hold the same, and the search sizes one for both (`search.pruning.cp_twin`;
    tests/test_planner_search.py: the search equals the exhaustive one, which sizes each)."""
    return max(_Ranks(plan, assume).sized(), key=lambda r: r.total)
