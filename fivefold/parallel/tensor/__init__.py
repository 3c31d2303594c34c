"""Tensor parallelism (Megatron-LM) and its sequence-parallel mode, over a TP group of t ranks.

  layers.py         column-parallel  Y_r = X A_r^T (A split by output rows) and row-parallel
                    Y = sum_r X_r B_r^T (B split by input columns), each a `TPMode`: ALL_REDUCE
                    (f / g = identity / all-reduce) or SEQUENCE_PARALLEL (all-gather / reduce-scatter
                    along the sequence); the vocab-parallel embedding; TP gradient sums.
  heads.py          which query / KV heads rank r holds (KV heads replicated when t > KV heads).
  cross_entropy.py  log p(y) = z_y - m - log S over a vocabulary split by columns, without any rank
                    holding the whole logits (two all-reduces: max, then sum and z_y).
A new TP layer goes in layers.py (or a module of its own here) and creates its parameters with
`param_meta.new_param`, so initialisation, checkpoints and the gradient path find its shards.
"""
