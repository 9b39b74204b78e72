"""Triton kernels, installed as `compactionrl_fast.kernels` (one op per file, or per `<op>_*.py` group; launchers
without autograd); modes.py: the ops' mode codes, for the package, these kernels and csrc/."""
if __name__ == "kernels":
    # Imported by the bare name because the repository root is on sys.path (a script or `python -c` run from
    # there). That name belongs to the `kernels` distribution, which transformers imports: hand the import to
    # it; without it, give an empty namespace package, what a folder without __init__.py gives (transformers
    # reads one as "not installed").
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None or _spec.loader is None:
        _spec = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        _spec.submodule_search_locations = []
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds when this file ends
    if _spec.loader is not None:
        _spec.loader.exec_module(_module)
