"""Which kernels every op of torch.ops.compactionrl_fast has: CPU, CUDA, Meta, Python fake.

    python benchmarks/op_kernels.py [--require-cuda] [--json FILE]

Run from the repository root (or a copy of it). Prints one line per op and exits 1 when
- an op has no Meta kernel and no fake implementation (torch.compile and FakeTensor cannot trace it),
- an op has neither a CPU kernel nor a device-generic (CompositeExplicitAutograd) one,
- with --require-cuda: the extension was built without CUDA (WITH_CUDA=0), or an op that csrc/cuda
  registers a CUDA kernel for has none (the CUDA objects were not linked in).
Ops with only a CPU kernel (value_head_*, segment_counts, segment_gae_params) run on CUDA tensors through Triton
or torch.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

KEYS = ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd")


def cuda_registered_in_sources(root="."):
    """Op names that csrc/cuda/*.cu registers CUDA kernels for."""
    names = set()
    for path in glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")):
        with open(path) as f:
            src = f.read()
        for block in re.findall(r"TORCH_LIBRARY_IMPL\(compactionrl_fast,\s*CUDA,[^{]*\{(.*?)\}", src, re.S):
            names.update(re.findall(r'm\.impl\("(\w+)"', block))
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--require-cuda", action="store_true")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.getcwd())
    import torch

    import compactionrl_fast  # noqa: F401 -- loads _C and registers the Python ops and fakes
    import compactionrl_fast.ops  # noqa: F401
    from compactionrl_fast.ops._dispatch import cpp_ext
    from torch._library import simple_registry

    ext = cpp_ext()
    with_cuda = int(getattr(ext, "WITH_CUDA", 0)) if ext is not None else None
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); compactionrl_fast._C: "
          f"{'not built' if ext is None else ext.__file__}; WITH_CUDA={with_cuda}")
    problems = []
    if args.require_cuda and with_cuda != 1:
        problems.append("the extension has no CUDA kernels (WITH_CUDA != 1)")
    want_cuda = cuda_registered_in_sources() if args.require_cuda else set()
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("compactionrl_fast::"))
    rows = []
    for name in names:
        has = {k: bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, k)) for k in KEYS}
        has["fake"] = simple_registry.singleton.find(name).fake_impl.kernel is not None
        rows.append(dict(op=name, **has))
        short = name.split("::")[1]
        flags = " ".join(f"{k}={'yes' if v else 'NO'}" for k, v in has.items())
        print(f"  {short:28s} {flags}")
        if not (has["Meta"] or has["fake"]):
            problems.append(f"{short}: no Meta kernel and no fake implementation")
        if not (has["CPU"] or has["CompositeExplicitAutograd"]):
            problems.append(f"{short}: no CPU kernel")
        if short in want_cuda and not has["CUDA"]:
            problems.append(f"{short}: csrc/cuda registers a CUDA kernel but the loaded extension has none")
    if not names:
        problems.append("no op registered under torch.ops.compactionrl_fast")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(with_cuda=with_cuda, ops=rows, problems=problems), f, indent=1)
    for p in problems:
        print(f"MISSING: {p}")
    print(f"{len(names)} ops, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
