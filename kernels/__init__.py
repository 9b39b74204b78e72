"""Triton kernels, installed as `compactionrl_fast.kernels` (one op per file, or per `<op>_*.py` group; launchers
without autograd); modes.py: the ops' mode codes, for the package, these kernels and csrc/."""
