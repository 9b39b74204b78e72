"""`python -m compactionrl_fast.kernels --write-header`: write csrc/common/modes.h from modes.py."""
import sys

from .modes import main

main(sys.argv[1:])
