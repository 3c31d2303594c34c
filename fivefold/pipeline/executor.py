"""The executor: runs one rank's action list of a verified Schedule on that rank's stage modules.

Per (stage s, microbatch mb) the rank keeps: the stage input x (a leaf that requires grad, so that B
can return dL/dx; token ids on stage 0), the output y (hidden (b, s, h), or on the last stage the
scaled loss sum(token CE) * loss_scale), and dL/dy once it arrives. Actions:

  F        y = stage(x); on the last stage y = loss_sum * loss_scale (the loss sum is recorded)
  B        dL/dx only (backward.backward_input), keeping what W needs; on a stage with full
           recompute the whole backward (as BW: a split one reruns the checkpointed forward per graph task)
  W        dL/dtheta from what B recorded (backward.backward_weight), accumulated into .grad
  BW       both in one pass (backward.backward_full); F&B runs its F, then its BW
  SEND_*/RECV_*  a run of consecutive communication actions is posted as one batched p2p call
           (comm.send_recv), receive buffers preallocated from the known activation shape; the
           rank waits for its receives before its next computation, and for each send before the
           computation that send_waits.send_policy names for the schedule (the next one, or the one
           after where waiting earlier could deadlock; a send completes only once its peer has
           posted the receive), or earlier when the send's Work reports completion (NCCL).

Megatron's deallocate trick: once the send of y has completed, y's storage is swapped for a
one-element tensor; only y.grad_fn (the graph) stays, and B/BW backpropagate through the graph edge,
which keeps the shape (backward.py). Between stages on the same rank (interleaved, DualPipeV) the
output is handed over in place of a send: the next stage gets y.detach() as its leaf input, and
dL/dx comes back as that stage's dL/dy.

Forward-only mode (evaluation loss, per-token log-probabilities) runs `forward_only(schedule)`
under no_grad: outputs are dropped as soon as they are sent or consumed.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fivefold.pipeline.backward import WeightPlan, backward_full, backward_input, backward_weight
from fivefold.pipeline.forward import forward_only
from fivefold.pipeline.ir import Action, Kind, Schedule
from fivefold.pipeline.send_waits import SendPolicy, send_policy

Key = tuple[int, int]  # (stage, microbatch)
MODES = ("train", "loss", "logprobs", "forward")
Tail = Callable[[nn.Module, torch.Tensor, int], object]
"""The caller's last-stage computation: (last stage module, its input x, microbatch) -> the scaled
loss to backpropagate (mode 'train') or anything to keep in RunResult.tails (mode 'forward')."""


@dataclass
class RunResult:
    loss_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    """mb -> sum of token cross-entropies (fp32, unscaled): on the rank holding the last stage."""
    token_counts: dict[int, torch.Tensor] = field(default_factory=dict)
    """mb -> target tokens counted by the loss: on the rank holding the last stage."""
    mtp_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    """mb -> (mtp_num_layers,) float64 MTP token-loss sums per depth (unscaled; fivefold.model.mtp):
    on the rank holding the last stage, with MTP."""
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    """mb -> (b, s) log p(label) in mode 'logprobs': on the rank holding the last stage."""
    tails: dict[int, object] = field(default_factory=dict)
    """mb -> what the caller's `tail` returned in mode 'forward': on the rank holding the last stage."""
    log: list[Action] = field(default_factory=list)
    """The actions in the order this rank ran them (equals the schedule's list for this rank)."""
    times: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each action in `log`, time.perf_counter() seconds, when tracing."""


class PipelineExecutor:
    """Runs `schedule` on one pipeline rank: `stages` maps each stage this rank holds to its module.

    `peer_rank(i)` turns pipeline rank i into the global rank p2p calls address (Group.global_rank).
    `activation_shape(ids_shape)` is the shape of a stage boundary tensor for a microbatch whose
    token ids have `ids_shape` (default (b, s, hidden)); `send_recv` is comm.send_recv.
    """

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module], pp_rank: int, *,
                 peer_rank: Callable[[int], int], send_recv: Callable, hidden_size: int,
                 activation_shape: Callable[[torch.Size], tuple[int, ...]] | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                 deallocate: bool = True):
        if sorted(stages) != schedule.stages_of(pp_rank):
            raise ValueError(f"pipeline rank {pp_rank} holds stages {schedule.stages_of(pp_rank)} in "
                             f"schedule {schedule.name}, got modules for {sorted(stages)}")
        self.schedule, self.stages, self.rank = schedule, stages, pp_rank
        self.peer_rank, self.send_recv = peer_rank, send_recv
        self.activation_shape = activation_shape or (lambda ids: (*ids, hidden_size))
        self.dtype, self.device, self.deallocate = dtype, device, deallocate
        self.last = schedule.num_stages - 1
        # On NCCL a batch of p2p ops completes as one group: a receive would then wait for the
        # sends batched with it, which the schedule's semantics (sends never block) do not allow.
        self.split_sends = device.type == "cuda"
        self._forward_only: Schedule | None = None
        self._policies: dict[bool, SendPolicy] = {}
        """Where sends are waited, by training (True) or forward-only schedule (send_waits)."""

    def params(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.stages[stage].parameters() if p.requires_grad]

    def run(self, input_ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor] | None = None, *,
            loss_scale: float | Sequence[float] = 1.0, mode: str = "train", trace: bool = False, docs: Sequence | None = None,
            noise: Sequence | None = None, tail: Tail | None = None) -> RunResult:
        """Run every action of this rank for one step. `input_ids[mb]` is needed on every rank (its
        shape sizes the receive buffers), `labels[mb]` on the rank of the last stage. Mode 'train'
        accumulates dL/dtheta (L = sum of losses * loss_scale, one scale per microbatch when a sequence) into .grad; 'loss' and 'logprobs' run
        the forward-only schedule without building a graph. `docs[mb]`: the microbatch's packed
        documents (fivefold.data.documents.PackedDocs), handed to every stage's forward; `noise[mb]`
        its dropout key (fivefold.model.dropout.DropoutKey) or None, likewise. `tail` (a loss of the
        caller's, as the RL engine's): the last stage runs `tail(module, x, mb)` instead of its own loss;
        in mode 'train' that is the scaled loss to backpropagate (RunResult.loss_sums keeps its value),
        in mode 'forward' (which needs a tail) any value, kept in RunResult.tails; labels are then unused."""
        if mode not in MODES or (mode == "forward") != (tail is not None and mode != "train"):
            raise ValueError(f"mode {mode!r} with tail {tail is not None}: one of {MODES}; 'forward' with a tail")
        if len(input_ids) != self.schedule.num_microbatches:
            raise ValueError(f"schedule {self.schedule.name} runs {self.schedule.num_microbatches} "
                             f"microbatches, got {len(input_ids)}")
        schedule = self.schedule
        if mode != "train":
            self._forward_only = self._forward_only or forward_only(schedule)
            schedule = self._forward_only
        policy = self._policies.get(mode == "train") or send_policy(schedule)
        self._policies[mode == "train"] = policy
        state = _StepState(list(input_ids), list(labels) if labels is not None else None, loss_scale, mode,
                           policy)
        state.docs = list(docs) if docs is not None else [None] * len(input_ids)
        state.noise = list(noise) if noise is not None else [None] * len(input_ids)
        state.tail = tail
        actions = schedule.ranks[self.rank]
        grad_ctx = torch.enable_grad() if mode == "train" else torch.no_grad()
        with grad_ctx:
            i = 0
            while i < len(actions):
                j = i
                while j < len(actions) and actions[j].kind.is_comm:
                    j += 1
                t0 = time.perf_counter()
                if j > i:
                    self._communicate(actions[i:j], state)
                    t1 = time.perf_counter()
                    state.result.log += actions[i:j]
                    state.result.times += [(t0, t1)] * (j - i)
                    i = j
                    continue
                self._reap(state, upto=state.computed)  # sends due now: their buffers go before it runs
                t0 = time.perf_counter()
                self._compute(actions[i], state)
                state.computed += 1
                state.result.log.append(actions[i])
                state.result.times.append((t0, time.perf_counter()))
                self._reap(state, upto=-1)
                i += 1
        self._reap(state, upto=None)
        if not trace:
            state.result.times = []
        return state.result

    # -- communication -------------------------------------------------------------------------
    def _communicate(self, run: Sequence[Action], st: "_StepState") -> None:
        sends, recvs, recv_keys = [], [], []
        for a in run:
            key, peer = (a.stage, a.mb), self.peer_rank(a.peer)
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                t = st.outputs[key] if a.kind is Kind.SEND_F else st.input_grads.pop(key)
                sends.append((t, peer))
                lag = st.policy.lag(a.kind)
                st.sent.append(_Sent(None, key, t if a.kind is Kind.SEND_F else None,
                                     None if lag is None else st.computed + lag))
            else:
                shape = self.activation_shape(st.input_ids[a.mb].shape)
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                recvs.append((buf, peer))
                recv_keys.append((a.kind, key, buf))
        n_new = len(sends)
        if self.split_sends and sends and recvs:
            works = list(self.send_recv(sends, [], tag="pp")) + list(self.send_recv([], recvs, tag="pp"))
        else:
            works = list(self.send_recv(sends, recvs, tag="pp"))
        for k in range(n_new):  # attach each send's Work to its entry
            st.sent[len(st.sent) - n_new + k].work = works[k]
        for w in works[n_new:]:
            w.wait()
        for kind, key, buf in recv_keys:
            if kind is Kind.RECV_F:
                st.inputs[key] = buf.requires_grad_(st.mode == "train")
            else:
                st.output_grads[key] = buf

    def _reap(self, st: "_StepState", upto: int | None) -> None:
        """Finish sends: wait those due before computation `upto` (every one when None), take those
        already complete, and free a sent activation's storage (its graph stays)."""
        keep = []
        for sent in st.sent:
            work, key, tensor = sent.work, sent.key, sent.tensor
            due = upto is None or (sent.due is not None and sent.due <= upto)
            if not (due or _completed(work)):
                keep.append(sent)
                continue
            work.wait()
            if tensor is not None:
                if st.mode == "train" and self.deallocate:
                    tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)
                if st.mode != "train" or key in st.done:
                    st.outputs.pop(key, None)
        st.sent = keep

    # -- computation ---------------------------------------------------------------------------
    def _compute(self, a: Action, st: "_StepState") -> None:
        for piece in a.pieces():
            key = (piece.stage, piece.mb)
            if piece.kind is Kind.F:
                self._forward(key, st)
            elif piece.kind is Kind.B and self.stages[key[0]].recompute.granularity != "full":
                dx, plan = backward_input(st.outputs[key], st.grad_of(key, self.last),
                                          st.inputs.get(key), self.params(key[0]))
                st.plans[key] = plan
                self._pass_input_grad(key, dx, st)
            elif piece.kind is Kind.W:
                if key in st.plans:
                    backward_weight(st.plans.pop(key))
                st.free(key)
            else:  # BW; or B on a stage with full recompute: a split backward would rerun the checkpointed
                # spans in B and in each of W's graph tasks (fivefold.pipeline.backward), so B runs the
                # whole backward and its W only frees
                dx = backward_full(st.outputs[key], st.grad_of(key, self.last), st.inputs.get(key),
                                   self.params(key[0]))
                self._pass_input_grad(key, dx, st)
                if piece.kind is not Kind.B:
                    st.free(key)

    def _forward(self, key: Key, st: "_StepState") -> None:
        s, mb = key
        module = self.stages[s]
        if s == 0:
            x = st.input_ids[mb].to(self.device)
        elif key not in st.inputs:  # the previous stage is on this rank: hand its output over
            prev = st.outputs[(s - 1, mb)]
            x = prev.detach().requires_grad_(st.mode == "train")
            if st.mode != "train":
                del st.outputs[(s - 1, mb)]
        else:
            x = st.inputs[key]
        st.inputs[key] = x
        docs = {} if st.docs[mb] is None else {"docs": st.docs[mb]}  # packed documents, when the batch has them
        if st.noise[mb] is not None:  # the micro-batch's dropout key
            docs["noise"] = st.noise[mb]
        if s < self.last:
            y = module(x, **docs)  # (b, s, h)
        elif st.tail is not None:
            out = st.tail(module, x, mb)
            if st.mode == "train":
                st.result.loss_sums[mb] = out.detach().float()
                st.outputs[key] = out
            else:
                st.result.tails[mb] = out
        elif st.mode == "logprobs":
            st.result.logprobs[mb] = module.logprobs(x, st.labels[mb].to(self.device), **docs)  # (b, s)
        else:
            if getattr(module, "mtp", None) is not None:  # MTP embeds the rolled token ids on the last stage
                docs["input_ids"] = st.input_ids[mb].to(self.device)
            loss_sum, count = module.loss(x, st.labels[mb].to(self.device), **docs)
            if docs.get("input_ids") is not None:
                st.result.mtp_sums[mb] = module.mtp_loss_sums
        if s < self.last:
            if y.dtype != self.dtype:
                raise RuntimeError(f"stage {s} returned {y.dtype}; the pipeline sends {self.dtype} activations")
            st.outputs[key] = y
        elif st.mode in ("train", "loss") and st.tail is None:
            st.result.loss_sums[mb] = loss_sum.detach().float()
            st.result.token_counts[mb] = torch.as_tensor(count).detach()
            if st.mode == "train":
                scale = st.loss_scale if isinstance(st.loss_scale, float | int) else st.loss_scale[mb]
                st.outputs[key] = loss_sum * scale
        if st.mode != "train":
            st.inputs.pop(key)

    def _pass_input_grad(self, key: Key, dx: torch.Tensor | None, st: "_StepState") -> None:
        s, mb = key
        if s == 0:
            return
        if self.schedule.placement[s - 1] == self.rank:
            st.output_grads[(s - 1, mb)] = dx
        else:
            st.input_grads[key] = dx


@dataclass
class _Sent:
    """A posted send: its Work, (stage, mb), the activation to free (None for an input gradient, whose
    only reference is the Work's), and the computation it is waited before (None: the step end)."""
    work: object
    key: Key
    tensor: torch.Tensor | None
    due: int | None


class _StepState:
    """Everything one step keeps per (stage, microbatch) on this rank."""

    def __init__(self, input_ids, labels, loss_scale: float, mode: str, policy: SendPolicy):
        self.input_ids, self.labels, self.loss_scale, self.mode = input_ids, labels, loss_scale, mode
        self.policy = policy
        self.computed = 0
        """Computations run so far this step."""
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.output_grads: dict[Key, torch.Tensor] = {}
        self.input_grads: dict[Key, torch.Tensor] = {}
        self.plans: dict[Key, WeightPlan] = {}
        self.sent: list[_Sent] = []
        self.done: set[Key] = set()
        """(stage, mb) whose backward has finished."""
        self.result = RunResult()
        self.tail: Tail | None = None

    def grad_of(self, key: Key, last: int) -> torch.Tensor | None:
        """dL/d(output) of (stage, mb): None on the last stage (the output is the loss itself)."""
        return None if key[0] == last else self.output_grads.pop(key)

    def free(self, key: Key) -> None:
        """The backward of `key` is done: drop its input and (unless a send still holds it) output."""
        self.inputs.pop(key, None)
        self.done.add(key)
        if not any(s.key == key and s.tensor is not None for s in self.sent):
            self.outputs.pop(key, None)


def _completed(work) -> bool:
    """Whether a send's Work (a torch Work, or comm's wrapper of them) is done, without blocking."""
    return bool(work.is_completed())
