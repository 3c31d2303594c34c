"""fivefold.parallel: the parallel layers and the data-parallel modes, one package per concern.

  tensor/   TP and its sequence-parallel mode: column / row parallel linears, the vocab-parallel
            embedding and cross-entropy, which attention heads a TP rank holds;
  context/  CP: the load-balanced sequence split and attention over it (ring, all-to-all, all-gather);
  expert/   EP / ETP: routed tokens dispatched to their experts and combined back;
  data/     DP and ZeRO-1/2/3: the gradient reducer, the data-parallel modes, the distributed
            optimizer, FSDP's parameter sharding, fp32 main parameters.
Shared by all: param_meta.py (how each parameter is held; read by the checkpoint too) and optimizer.py
(AdamW's groups, the global-norm clip and `OptimShard`, the optimizer-state unit the checkpoint reads:
it stays beside param_meta because fivefold.checkpoint imports it). Pipeline parallelism lives in
fivefold.pipeline. Every group is passed in (fivefold.runtime.mesh.Group); none is fetched from a global.
"""
