"""Triton kernels, installed as `compactionrl_fast.kernels` (one op per file, launchers without autograd)."""
