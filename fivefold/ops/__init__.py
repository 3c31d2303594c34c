"""Kernels behind device-independent interfaces (fivefold.ops.attention: every attention call)."""
