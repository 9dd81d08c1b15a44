"""Kernels: each Triton kernel beside its torch reference; ``ops`` picks one by device."""
