"""Data parallelism and ZeRO: how gradients are reduced and who steps which part of the optimizer.

Each rank's gradient is of sum(token losses) / N_global, so summing over the DP x CP group gives the
gradient of the global per-token mean loss (not a mean of per-rank means).
  reducer.py                `GradReducer`: gradients in flat buckets, all-reduced (or reduce-scattered)
                            as backward completes each bucket.
  data_parallel.py          `DataParallel`, `DPMode` (no_shard, optim = ZeRO-1, optim_grads = ZeRO-2,
                            optim_grads_params = ZeRO-3): one gradient and optimizer path for dense and
                            expert parameters, clipping, fp16 loss scaling.
  distributed_optimizer.py  ZeRO-1/2: AdamW on this rank's 1/d chunk of each bucket, parameters
                            all-gathered back.
  fsdp.py                   ZeRO-3: parameters sharded per unit, gathered before use and freed after.
  main_params.py            fp32 main parameters for 16-bit (or offloaded) parameters.
A new mode is a `DPMode` member in data_parallel.py, with its mechanics in a module of its own here.
"""
