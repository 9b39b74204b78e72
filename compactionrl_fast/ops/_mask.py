"""Masks that adapters receive as int or float 0/1 tensors (verl, OpenRLHF), as bool: one C++ pass on CPU
(`compactionrl_fast::mask_to_bool`, csrc/cpu/mask_to_bool.cpp) converts, counts and checks; torch elsewhere."""
from __future__ import annotations

import torch

from ._register import register_op
from ._validate import check_tensor, value_checks


def bool_mask_and_count(name, mask, ndim=2):
    """(`as_bool_mask(name, mask, ndim)`, its number of True values when the conversion counted them (a
    non-bool mask on CPU), else None)."""
    check_tensor(name, mask, ndim=ndim)
    if mask.dtype == torch.bool:
        return mask, None
    if not (mask.numel() and value_checks(mask)):
        return mask.to(torch.bool), None
    count = None
    if mask.device.type == "cpu" and mask.dtype in _MASK_OP_DTYPES and _HAS_MASK_OP:
        # one C++ pass converts, counts the True values and finds any value other than 0 and 1 (NaN too)
        out, counts = torch.ops.compactionrl_fast.mask_to_bool(mask)
        count, other = counts.tolist()
        ok = other == 0
    else:
        out = mask.to(torch.bool)
        ok = _zero_one(mask, out)
    if not ok:
        raise ValueError(f"{name} must hold only 0 and 1")
    return out, count


def _zero_one(mask, nonzero) -> bool:
    """Whether every value of `mask` is 0 or 1 (`nonzero`: mask.to(bool)), where the C++ pass is not there.
    Integers: their range, one reduction; floats: "nonzero" and "equal to 1" agree everywhere (NaN is
    nonzero, not 1)."""
    if not mask.is_floating_point():
        lo, hi = torch.aminmax(mask)
        return bool(lo >= 0) and bool(hi <= 1)
    return torch.equal(nonzero, mask == 1)


def _mask_to_bool_fake(mask):
    return torch.empty_like(mask, dtype=torch.bool), mask.new_empty(2, dtype=torch.int64)


_HAS_MASK_OP = register_op("mask_to_bool", _mask_to_bool_fake)  # the C++ op (csrc/cpu/mask_to_bool.cpp), where built
_MASK_OP_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                   torch.float32, torch.float64)
