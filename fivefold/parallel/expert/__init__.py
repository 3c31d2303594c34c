"""Expert parallelism (EP) and expert tensor parallelism (ETP) for MoE layers.

  dispatch.py  EP over n ranks (rank r holds experts [r E/n, (r+1) E/n)): tokens permuted by expert,
               all-to-all dispatch, each expert's SwiGLU (grouped GEMM where available), all-to-all
               combine, y_t = sum_k w_tk expert_k(x_t). ETP splits each expert over m ranks as a
               column -> row parallel pair (rows all-gathered, partial outputs reduce-scattered).
A new token dispatcher (e.g. all-gather, or capacity-dropping variants) goes in a module of its own here;
the experts' gradients are reduced by fivefold.parallel.data (their EDP domain).
"""
