"""`python -m compactionrl_fast.kernels --write-header`: write csrc/common/modes.h from modes.py (the builds do it
themselves; for compiling by hand)."""
import sys

from .modes import main

main(sys.argv[1:])
