"""How context-parallel attention cuts its K/V into pieces, and the per-rank memory that gives (pure).

Ring attention (fivefold/parallel/context/ring_attention.py) sends each rank's K/V in m pieces as a
wavefront; `ring_pieces` chooses m. `attention_peak_bytes` is docs/context_parallel.md's
"Memory per rank": the peak bytes one rank creates in one attention forward + backward, which
benchmarks/cp_attention.py and tests/test_cp.py compare with the measured peak.
"""
from __future__ import annotations

MAX_PIECES = 32
"""K/V pieces per rank at most (memory per rank falls with more; each costs a message per hop)."""
MIN_PIECE_TOKENS = 64
"""Fewest tokens in a piece (kernel efficiency): short sequences travel in fewer, larger pieces."""
ROW_TILES = 4
"""Query-row tiles per remote piece (bounds the dQ temporary to rows/ROW_TILES)."""


def ring_pieces(s_loc: int) -> int:
    """Pieces a rank's K/V (s_loc tokens: two chunks) travels in: even (each chunk cut alike), at most
    MAX_PIECES, pieces of at least MIN_PIECE_TOKENS tokens where the chunk allows, dividing the chunk."""
    c = s_loc // 2
    per_chunk = max(1, min(MAX_PIECES // 2, c // MIN_PIECE_TOKENS))
    while c % per_chunk:
        per_chunk -= 1
    return 2 * per_chunk


def attention_peak_bytes(*, b: int, s: int, heads: int, kv_heads: int, d: int, dv: int, a2a: int = 1,
                         ring: int = 1, e: int = 4) -> float:
    """Peak bytes one rank creates in one causal attention forward + backward over CP = a2a x ring
    ranks (1 x 1: one process), e bytes per activation element (the fp32 accumulators counted at 4):
        one process of t = s/CP tokens: O, dQ, dK + dV                       Q + Q + KV32
        all-to-all (a2a > 1): q, k, v re-laid and kept, dO's two copies        Q + KV + 2 O,
            unless the forward's last all-to-all peaks higher: q, k, v re-laid, the attention's
            output, its re-ordered copy and the all-to-all's three buffers      Q + KV + 5 O
        ring (ring > 1): K/V pieces held and in flight   (2P - 1) KV / m,
                         dK/dV pieces computed, sent and received   3 (P - 1) KV32 / m,
                         one kernel call's dQ, dK, dV   Q / ROW_TILES + KV32 / m."""
    n = a2a * ring
    t = s // n
    g = kv_heads if kv_heads % a2a == 0 else heads  # the all-to-all copies KV heads it cannot split
    Q, O = b * heads * t * d * e, b * heads * t * dv * e
    KV, KV32 = b * g * t * (d + dv) * e, b * g * t * (d + dv) * 4
    Q32, O32 = b * heads * t * d * 4, b * heads * t * dv * 4
    peak = O32 + Q32 + KV32
    if a2a > 1:
        peak += Q + KV + 2 * O
    if ring > 1:
        m = ring_pieces(s // ring)
        peak += (2 * ring - 1) * KV / m + (3 * (ring - 1) + 1) * KV32 / m + Q32 / ROW_TILES
    if a2a > 1:  # comm.all_to_all stacks its input, receives into a buffer and re-lays it out (3 copies)
        peak = max(peak, Q + KV + 5 * O)
    return peak
