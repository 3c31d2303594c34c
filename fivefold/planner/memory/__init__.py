"""Memory per GPU: what a pipeline rank holds at its peak, by kind.

params.py counts parameters, mtp.py the multi-token-prediction layers; states.py turns a rank's
parameters into weights, gradients and optimizer state; traits.py and activations.py count the
tensors a layer saves, cp_memory.py the context-parallel attention's working set; layers.py sums a
rank's layers, peak.py assembles the peak (kinds.py: `RankMemory`, `MemoryAssumptions`). A new kind
of saved tensor goes in activations.py; a new state or buffer in states.py; its place in the peak in
peak.py.
"""
