"""Context parallelism (CP): the sequence split over CP ranks, attention by ring (p2p) or all-to-all.

Sequence split (Megatron's load balancing for causal attention): a sequence of s tokens is cut into
2n chunks of s/(2n); CP rank r keeps chunks r and 2n-1-r, in that order. Every rank then has the
same amount of causal attention work (an early chunk, which sees little, paired with a late one).
Token ids, labels and RoPE positions are split the same way before the model (`split_tokens`,
`local_positions`); everything outside attention is per token and needs no communication.

Attention with a CP group of n = a x p ranks (`ContextParallel`: `a2a` group of a ranks, `ring`
group of p ranks; cp_comm_type p2p: a = 1, a2a: p = 1, a2a+p2p: [a, p]):
  1. a2a (Ulysses): all-to-all over `a2a` turns q, k, v (b, heads, s/n, d) into
     (b, heads/a, s/p, d); the a local pieces are re-ordered so that the rank holds chunks q and
     2p-1-q of a 2p split (q its ring rank), the layout the ring expects.
  2. ring over `ring` (ring_attention): Q stays, K/V blocks go round; partial attentions are merged by
     their log-sum-exp. With p = 1 this is plain causal attention on the whole sequence.
  3. all-to-all back to (b, heads, s/n, dv).
The a2a groups are consecutive CP ranks and the ring groups stride over them (Layout.cp_a2a), which
is what makes step 1's re-ordering a load-balanced split of size 2p. cp_comm_type allgather (a = 1):
K and V gathered from the whole group instead of a ring (allgather_attention; Layout.cp_gather).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fivefold.data.loader import IGNORE_INDEX
from fivefold.errors import UserError
from fivefold.ops.attention import Documents, attention as backend_attention
from fivefold.parallel.context.allgather_attention import allgather_attention
from fivefold.parallel.context.chunks import local_positions, split_sequence
from fivefold.parallel.context.ring_attention import ring_attention
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


def local_document_positions(positions: torch.Tensor, s_local: int, n: int, r: int) -> torch.Tensor:
    """Per-row RoPE positions (b, s) of packed documents (restarting per document) -> CP rank r's
    (b, s_local): right-padded first to s_local * n (as split_tokens pads, counting on), then split."""
    pad = s_local * n - positions.shape[1]
    if pad:
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1)], dim=1)
    return split_sequence(positions, 1, n, r)


def split_tokens(ids: torch.Tensor, labels: torch.Tensor, cp: Group | ContextParallel, multiple: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, labels (b, s) -> this CP rank's (b, s/cp). Sequences are first right-padded (ids 0,
    labels IGNORE_INDEX: no loss, and causal attention keeps them out of every real token's
    context) to a multiple of `2*cp*multiple` (`multiple` = TP under sequence
    parallelism), so unpacked batches of any width split evenly. Identity when cp has one rank."""
    if cp.size == 1:
        return ids, labels
    step = 2 * cp.size * multiple
    pad = -ids.shape[1] % step
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)
    return split_sequence(ids, 1, cp.size, cp.rank), split_sequence(labels, 1, cp.size, cp.rank)


def gather_tokens(x: torch.Tensor, cp: Group | ContextParallel, tag: str = "cp") -> torch.Tensor:
    """Per-token values of this CP rank's tokens (b, s/cp, ...) -> those of the whole (padded)
    sequence (b, s, ...) in sequence order, on every CP rank; backward keeps this rank's tokens'
    gradient (each rank then differentiates the same whole-sequence function). The inverse of
    split_sequence over the CP ranks."""
    if cp.size == 1:
        return x
    if isinstance(cp, ContextParallel):  # CP index = ring rank * a2a size + a2a rank
        x = comm.gather_split(comm.gather_split(x, 1, cp.a2a, tag), 1, cp.ring, tag)
    else:
        x = comm.gather_split(x, 1, cp, tag)
    s_local = x.shape[1] // cp.size
    where = torch.cat([local_positions(s_local, cp.size, j) for j in range(cp.size)])
    return x.index_select(1, torch.argsort(where).to(x.device))


def _unit_order(a: int) -> list[int]:
    """After the a2a the sequence is cat_i [A_i, B_i] (member i's chunks, each a unit); the ring
    wants [A_0 .. A_{a-1}, B_{a-1} .. B_0] (two contiguous runs of the global order)."""
    return [2 * i for i in range(a)] + [2 * i + 1 for i in reversed(range(a))]


def _permute_units(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """x (b, h, s, d): cut s into len(order) units and put unit order[j] at place j."""
    b, h, s, d = x.shape
    u = len(order)
    return x.view(b, h, u, s // u, d)[:, :, order].reshape(b, h, s, d)


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for j, i in enumerate(order):
        inv[i] = j
    return inv


@dataclass(frozen=True)
class ContextParallel:
    """How one attention layer's CP group is used: all-to-all over `a2a`, ring over `ring`
    (a2a.size x ring.size = CP; a rank's CP index is ring.rank * a2a.size + a2a.rank)."""

    a2a: Group
    ring: Group
    tag: str = "cp"
    gathers: bool = False
    """K and V all-gathered over `ring` (the whole group; cp_comm_type allgather) instead of a ring."""

    @property
    def size(self) -> int:
        return self.a2a.size * self.ring.size

    @property
    def rank(self) -> int:
        """This rank's CP index (which chunks of the sequence it holds)."""
        return self.ring.rank * self.a2a.size + self.a2a.rank

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  docs: Documents | None = None) -> torch.Tensor:
        """Causal softmax(q k^T * scale) v over the whole sequence, for this rank's tokens.
        q (b, a, s/cp, d), k (b, g, s/cp, d), v (b, g, s/cp, dv) -> (b, a, s/cp, dv); a % g == 0.
        `docs`: the global document boundaries of the whole (b, s) batch (each attends to itself)."""
        if self.gathers:
            return allgather_attention(q, k, v, self.ring, tag=self.tag, scale=scale, docs=docs)
        n = self.a2a.size
        if n > 1:
            if k.shape[1] % n:  # too few KV heads to split: give every query head its own copy
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (b, a, s/cp, d|dv)
            order = _unit_order(n)
            q, k, v = (_permute_units(comm.all_to_all(t, 1, 2, self.a2a, self.tag), order)
                       for t in (q, k, v))  # (b, heads/n, s/ring, d)
        if self.ring.size > 1:
            o = ring_attention(q, k, v, self.ring, tag=self.tag, scale=scale, docs=docs)  # (b, a/n, s/ring, dv)
        else:  # the a2a gave this rank whole sequences
            o = backend_attention(q, k, v, scale=scale, docs=docs)
        if n > 1:
            o = comm.all_to_all(_permute_units(o, _inverse(_unit_order(n))), 2, 1, self.a2a, self.tag)
        return o  # (b, a, s/cp, dv)


    def whole_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, heads, s/cp, d) of this rank's chunks -> (b, heads, s, d) of every rank's, in CP-index
        order (all-gather over a2a, then ring; backward reduce-scatters), and their global positions
        (s,). For attention that needs all keys at once (attention dropout's explicit path)."""
        s_local = x.shape[2]
        x = comm.gather(comm.gather(x, 2, self.a2a, self.tag), 2, self.ring, self.tag)
        positions = torch.cat([local_positions(s_local, self.size, j, x.device) for j in range(self.size)])
        return x, positions


def context_parallel_of(mesh, heads_per_rank: int) -> ContextParallel | None:
    """The mesh's CP attention groups ("cp-a2a", "cp-ring"), or None without CP. `heads_per_rank`:
    the query heads of this TP rank, which the all-to-all splits over the a2a group."""
    if mesh is None or mesh.cp.size == 1:
        return None
    cp = ContextParallel(mesh.group("cp-a2a"), mesh.group("cp-ring"), gathers=mesh.layout.cp_gather)
    if heads_per_rank % cp.a2a.size:
        raise UserError(f"all-to-all context parallelism over {cp.a2a.size} ranks needs the {heads_per_rank} "
                        f"attention heads per TP rank divisible by {cp.a2a.size} (lower the a2a size of "
                        "hierarchical_context_parallel_sizes, or use cp_comm_type p2p)")
    return cp
