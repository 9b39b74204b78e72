"""What tests/test_aot.py compiles ahead of time for sm_80/sm_90: {module: its `AOT`} for every kernels/ module
that declares one. Each kernels module with Triton kernels declares, as a module-level `AOT` next to the
kernels and the launch sizes, the list [(kernel name, signature, constexprs[, compile options])] as
`triton.compiler.ASTSource` takes them (tests/_aot.py; a new op's kernels/my_op.py: docs/adding-an-op.md).
"""
import importlib
import pkgutil

import compactionrl_fast.kernels as _pkg

_MODULES = (importlib.import_module(f"{_pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(_pkg.__path__)
            if not m.name.startswith("_"))
SPECS = {m.__name__.rsplit(".", 1)[-1]: list(m.AOT) for m in _MODULES if hasattr(m, "AOT")}
