"""A stage's backward in two halves, for zero-bubble schedules: B (input gradient) then W (weights).

For a stage y = f(x; theta) and an incoming dL/dy, the full backward computes dL/dx and dL/dtheta in
one pass. B computes only dL/dx, keeping the graph, and records, at each graph node where a
weight's branch joins the input path (the "joins": e.g. the MmBackward of `x @ w.T`, whose inputs
are the activation, on the input path, and w), the gradient that arrived at that node. W then
starts from those joins with the recorded gradients and walks only the weights' branches:

    dL/dtheta = sum over joins j of (d out_j / d theta)^T  g_j,   g_j = dL/d out_j recorded during B

so nothing on the input path is computed twice. Weights joined by a common node (a weight used at
two places, or two weights sharing a node) form one group and get one backward call; in a
group with several joins, a pre-hook pins each join's gradient to its recorded value, so gradient
that reaches one join through another is not counted twice. Each call is its own graph task, and
torch.utils.checkpoint keys what it recomputes by the task: a checkpointed span (full recompute)
would rerun its forward in B and again in every group's call of W (the executor runs such a stage's
B as the whole backward instead, fivefold.pipeline.executor). Weights whose branch never meets the
input path (all of them on the first stage, whose input is token ids) are computed by W with a
plain backward from the output. The idea is torch.distributed.pipelining's stage_backward_input /
stage_backward_weight; this is a smaller rewrite of it. BW and W add each weight's gradient where it
accumulates as autograd makes it (`_accumulate`), not all of a stage's at the end of the call.

Outputs are passed as GradientEdges, not tensors, so an output whose storage was freed after its
send (Megatron's deallocate trick) still backpropagates: autograd checks the incoming gradient
against the node's recorded shape, not the tensor's current one.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from fivefold.runtime.backward_pass import input_grads_only


def _node(t: torch.Tensor) -> Node:
    """The node gradients of `t` flow into: its grad_fn, or its AccumulateGrad for a leaf."""
    return get_gradient_edge(t).node


def _parents(root: Node) -> dict[Node, list[Node]]:
    """For each node reachable from `root`, the nodes that pass gradient into it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = {root}, deque([root])
    while queue:
        n = queue.popleft()
        for child, _ in n.next_functions:
            if child is None:
                continue
            parents[child].append(n)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upward(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes above `start` (towards the output) not in `stop`, and the `stop` nodes met on the way."""
    seen, met, queue = {start}, set(), deque([start])
    while queue:
        for p in parents.get(queue.popleft(), ()):
            if p in stop:
                met.add(p)
            elif p not in seen:
                seen.add(p)
                queue.append(p)
    return seen, met


@dataclass(eq=False)
class _Group:
    params: list[torch.nn.Parameter]
    joins: list[Node]
    grads: list[tuple | None] = field(default_factory=list)


@dataclass
class WeightPlan:
    """What B leaves for W: joined groups with their recorded gradients, and the unjoined weights."""

    groups: list[_Group]
    unjoined: list[torch.nn.Parameter]
    output: GradientEdge | None
    grad_output: torch.Tensor | None


def _edge(output: torch.Tensor) -> GradientEdge:
    return get_gradient_edge(output)


def _accumulate(edges: list[GradientEdge], grads: list, params: list[torch.Tensor],
                retain_graph: bool = False) -> None:
    """Backpropagate `grads` from `edges` into `params`, each gradient added where its parameter's
    gradients accumulate as soon as it is computed (autograd's AccumulateGrad into `.grad`, which a
    GradReducer points at its main_grad buffer, or its hook adds into a wider one:
    fivefold.parallel.data.reducer). `autograd.grad` over the parameters would hold every gradient of the
    stage until it returns (measured: a whole stage's parameters in fp32, 20 MiB of a 115 MiB peak)."""
    inputs = [p for p in params if p.requires_grad]
    if inputs:
        torch.autograd.backward(edges, grads, retain_graph=retain_graph, inputs=inputs)


def backward_full(output: torch.Tensor, grad_output: torch.Tensor | None, stage_input: torch.Tensor | None,
                  params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """BW: accumulate dL/dtheta into each param's .grad and return dL/d(stage_input) (None without one)."""
    with_input = stage_input is not None and stage_input.requires_grad
    if grad_output is None:
        grad_output = torch.ones((), dtype=output.dtype, device=output.device)
    _accumulate([_edge(output)], [grad_output], ([stage_input] if with_input else []) + params)
    if not with_input:
        return None
    dx, stage_input.grad = stage_input.grad, None  # the input's gradient, accumulated into its .grad
    return dx


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, stage_input: torch.Tensor | None,
                   params: list[torch.nn.Parameter]) -> tuple[torch.Tensor | None, WeightPlan]:
    """B: dL/d(stage_input), keeping the graph; the returned plan lets `backward_weight` finish."""
    params = [p for p in params if p.requires_grad]
    if grad_output is None:
        grad_output = torch.ones((), dtype=output.dtype, device=output.device)
    out_edge = _edge(output)
    if stage_input is None or not stage_input.requires_grad:
        return None, WeightPlan([], params, out_edge, grad_output)
    parents = _parents(out_edge.node)
    input_path, _ = _upward(_node(stage_input), parents, set())
    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}
    unjoined = []
    for p in params:
        _, joins = _upward(_node(p), parents, input_path)
        if not joins:
            unjoined.append(p)
            continue
        found = {id(group_of[j]): group_of[j] for j in joins if j in group_of}
        g = _Group([p], sorted(joins, key=id))
        for other in found.values():  # merge every group sharing a join with this weight
            g.params += other.params
            g.joins += [j for j in other.joins if j not in g.joins]
            groups.remove(other)
        groups.append(g)
        for j in g.joins:
            group_of[j] = g
    handles = []
    for g in groups:
        g.grads = [None] * len(g.joins)
        for i, j in enumerate(g.joins):
            def record(grad_outputs, g=g, i=i):
                g.grads[i] = grad_outputs
            handles.append(j.register_prehook(record))
    try:
        with input_grads_only():
            (dx,) = torch.autograd.grad([out_edge], [stage_input], [grad_output], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    plan = WeightPlan(groups, unjoined, out_edge if unjoined else None, grad_output if unjoined else None)
    return dx, plan


def backward_weight(plan: WeightPlan) -> None:
    """W: accumulate dL/dtheta into each param's .grad from what B recorded; frees the graph. Each
    call but the last keeps the graph: groups may share nodes below their joins (a tied output
    layer that MTP also embeds and projects with on the last stage: the second call found the saved
    tensors freed), and what a call would free is alive at W's start anyway."""
    calls = []
    for g in plan.groups:
        edges, grads = [], []
        for j, recorded in zip(g.joins, g.grads):
            for k, gr in enumerate(recorded or ()):
                if gr is not None:
                    edges.append(GradientEdge(j, k))
                    grads.append(gr)
        if edges:
            calls.append((g, edges, grads))
    for i, (g, edges, grads) in enumerate(calls):
        handles = [j.register_prehook(lambda _, r=r: r) for j, r in zip(g.joins, g.grads)] \
            if len(g.joins) > 1 else []
        try:
            _accumulate(edges, grads, g.params, retain_graph=plan.output is not None or i + 1 < len(calls))
        finally:
            for h in handles:
                h.remove()
    if plan.unjoined:
        _accumulate([plan.output], [plan.grad_output], plan.unjoined)
    plan.groups, plan.unjoined, plan.output, plan.grad_output = [], [], None, None
