"""Context parallelism (CP) over n = a x p ranks: the sequence split, and attention across the split.

  chunks.py               the load-balanced split: s tokens cut into 2n chunks, rank r keeps chunks
                          r and 2n-1-r (equal causal work per rank); RoPE positions split alike.
  context_parallel.py     `ContextParallel.attention`: all-to-all over a (Ulysses, heads <-> sequence),
                          then the ring over p; token / label split and gather.
  ring_attention.py       cp_comm_type p2p: K/V blocks go round the ring, partial outputs merged by
                          log-sum-exp, O = sum_i exp(L_i - L) O_i.
  allgather_attention.py  cp_comm_type allgather: K and V of the whole sequence gathered, dK / dV
                          reduce-scattered in backward.
A new exchange (cp_comm_type) goes in a module of its own here, dispatched from ContextParallel.attention.
"""
