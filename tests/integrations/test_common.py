"""The adapters' shared helpers (integrations/_common.py): config lookup, number checks, whitening, the
denominator of a data-parallel count and the masked mean, each against a direct computation."""
import types

import numpy as np
import pytest
import torch

from compactionrl_fast.integrations._common import cfg_get, denominator_from, masked_mean, masked_whiten, number


def test_cfg_get_reads_dicts_objects_and_defaults():
    assert cfg_get({"a": 1}, "a", 5) == 1
    assert cfg_get({"a": None}, "a", 5) is None  # an explicit None stays None
    assert cfg_get({}, "a", 5) == 5
    assert cfg_get(types.SimpleNamespace(a=2), "a", 5) == 2
    assert cfg_get(types.SimpleNamespace(), "a", 5) == 5
    assert cfg_get(None, "a", 5) == 5
    assert cfg_get(None, "a") is None

    class NotCallableGet:  # an attribute named `get` that is not a method: read as an attribute
        get = 3
        a = 4

    assert cfg_get(NotCallableGet(), "a", 5) == 4


def test_number_accepts_numbers_and_names_the_argument():
    assert number("x", 2) == 2.0 and isinstance(number("x", 2), float)
    assert number("x", np.float32(0.5)) == 0.5
    assert number("x", torch.tensor(1.5)) == 1.5
    for bad in [True, "1", b"1", None, [1.0], torch.ones(2)]:
        with pytest.raises(TypeError, match="^x must be a number"):
            number("x", bad)
    with pytest.raises(TypeError, match="got list"):  # the type that was passed
        number("x", [1.0])


def test_masked_whiten_equals_direct_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=g) * 2 + 1
    mask = torch.rand(3, 7, generator=g) < 0.6
    xm = x.double()[mask]
    want = (x.double() - xm.mean()) / torch.sqrt(xm.var(unbiased=True) + 1e-8)
    got = masked_whiten(x, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[mask].double(), want[mask], rtol=1e-6, atol=1e-6)
    assert not got[~mask].any()
    # eps matters when the variance is tiny
    c = torch.tensor([1.0, 1.0 + 1e-4, 1.0 - 1e-4])
    m = torch.ones(3, dtype=torch.bool)
    v = torch.tensor([1.0, 1.0 + 1e-4, 1.0 - 1e-4]).double().var()
    torch.testing.assert_close(masked_whiten(c, m, eps=1e-6).double(),
                               (c.double() - c.double().mean()) / torch.sqrt(v + 1e-6), rtol=1e-5, atol=1e-6)


def test_masked_whiten_needs_two_tokens():
    x = torch.randn(4)
    m = torch.tensor([False, True, False, False])
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, m)
    m[2] = True  # two is enough
    out = masked_whiten(x, m)
    assert out[m].abs().sum() > 0


def test_denominator_from_divides_by_dp_size():
    assert denominator_from(None, 2) is None
    assert denominator_from(10, 4) == 2.5
    d = denominator_from(torch.tensor([12.0], requires_grad=True), 4)
    assert d.dtype == torch.float64 and d.shape == () and not d.requires_grad and float(d) == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_masked_mean_ignores_masked_positions(dtype):
    x = torch.tensor([1.0, 2.0, float("nan"), 4.0, float("inf")], dtype=dtype)
    mask = torch.tensor([True, True, False, True, False])
    got = masked_mean(x.clone(), mask)
    assert got.dtype == torch.float64 and float(got) == pytest.approx(7.0 / 3)
    finite = torch.tensor([1.0, 2.0, 30.0, 4.0], dtype=dtype)
    assert float(masked_mean(finite.clone(), mask[:4])) == pytest.approx(7.0 / 3)
    assert float(masked_mean(x.clone(), torch.zeros(5, dtype=torch.bool))) == 0.0
    one = torch.tensor([False, False, False, True, False])
    assert float(masked_mean(x.clone(), one)) == 4.0
