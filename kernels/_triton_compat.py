"""Triton 3.6 interpreter fix for numpy >= 2.4 (imported by every kernel module; no effect elsewhere).

The interpreter (TRITON_INTERPRET=1) holds every scalar as a shape-[1] numpy array and turns it into a
Python int for `range(n)` with `int(array)`, which numpy 2.4 forbids ("only 0-dimensional arrays can be
converted to Python scalars"). So any `for` loop whose bound is a runtime scalar fails there, whatever
the bound's formulation (`n`, `tl.cdiv(n, B)`, `range(a, n, step)`, a reduction, a load: all shape [1]).
Triton 3.7 squeezes the array first; this does the same on 3.6. Compiled kernels are not touched.
"""
import triton


def _version():
    try:
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return (0, 0)


def _patch_interpreter():
    if _version() != (3, 6):
        return
    try:
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 -- no interpreter, nothing to fix
        return
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_crf_squeezed", False):
        return

    def patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        # set after the original: the scope restores in reverse order, so both are undone on exit
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._crf_squeezed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_patch_interpreter()
