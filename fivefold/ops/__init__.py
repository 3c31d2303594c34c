"""Kernels behind device-independent interfaces (fivefold.ops.attention: every attention call;
fivefold.ops.counting: assignments per expert without a host sync)."""
