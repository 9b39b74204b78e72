"""The C++ CPU ops' output cache (csrc/cpu/output_cache.cpp, `compactionrl_fast.output_cache`): outputs of
1 MiB and more reuse blocks that freed outputs gave back, results equal with the cache on and off, the limit
and `clear` hold, storage stays an ordinary resizable CPU tensor, and blocks freed on other threads return."""
import threading

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast import reference as ref

pytest.importorskip("compactionrl_fast._C")

T_BIG = 1 << 19  # [T] float32 = 2 MiB: cached
T_SMALL = 1 << 12  # 16 KiB: glibc's


@pytest.fixture
def cache():
    saved = crf.output_cache()["limit_bytes"]
    crf.output_cache(clear=True)
    yield
    crf.output_cache(limit_bytes=saved, clear=True)


def _gae(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, T // 3, T // 3, T], dtype=torch.int64)  # an empty segment included
    mask = torch.rand(T, generator=g) < 0.7
    return crf.segment_gae(torch.randn(T, generator=g), torch.randn(T, generator=g), mask, cu,
                           gamma=0.99, lam=0.95, backend="cpp")


def test_freed_outputs_are_reused(cache):
    adv, ret = _gae(T_BIG)
    ptrs = {adv.data_ptr(), ret.data_ptr()}
    del adv, ret
    s0 = crf.output_cache()
    assert s0["cached_bytes"] >= 2 * T_BIG * 4
    adv, ret = _gae(T_BIG, seed=1)
    s1 = crf.output_cache()
    assert s1["hits"] - s0["hits"] == 2 and s1["misses"] == s0["misses"]
    assert {adv.data_ptr(), ret.data_ptr()} == ptrs


def test_small_outputs_bypass_the_cache(cache):
    before = crf.output_cache()
    _gae(T_SMALL)
    after = crf.output_cache()
    assert (after["hits"], after["misses"], after["cached_bytes"]) == (before["hits"], before["misses"], 0)


@pytest.mark.parametrize("limit", [0, 256 << 20])
def test_results_do_not_depend_on_the_cache(cache, limit):
    """A reused block held another call's numbers: the op's result must not see them (the suite also poisons
    every output with NaN before the kernel writes it)."""
    crf.output_cache(limit_bytes=limit)
    _gae(T_BIG, seed=5)  # leaves blocks with other values behind
    g = torch.Generator().manual_seed(2)
    T = T_BIG
    lp = torch.randn(T, generator=g, dtype=torch.float64).float().requires_grad_()
    old, adv = torch.randn(T, generator=g), torch.randn(T, generator=g)
    mask = torch.rand(T, generator=g) < 0.6
    cu = torch.tensor([0, 1000, T], dtype=torch.int32)
    loss, _ = crf.ppo_policy_loss(lp, old, adv, mask, cu_seqlens=cu)
    (grad,) = torch.autograd.grad(loss, lp)
    lp64 = lp.detach().double().requires_grad_()
    rloss, _ = ref.ppo_policy_loss(lp64, old.double(), adv.double(), mask, cu_seqlens=cu)
    (rgrad,) = torch.autograd.grad(rloss, lp64)
    torch.testing.assert_close(loss.double(), rloss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), rgrad, rtol=1e-5, atol=1e-9)


def test_limit_and_clear(cache):
    crf.output_cache(limit_bytes=3 << 20)  # one 2 MiB block fits, two do not
    adv, ret = _gae(T_BIG)
    del adv, ret
    s = crf.output_cache()
    assert 0 < s["cached_bytes"] <= 3 << 20 and s["limit_bytes"] == 3 << 20
    assert crf.output_cache(clear=True)["cached_bytes"] == 0
    crf.output_cache(limit_bytes=0)
    adv, ret = _gae(T_BIG)
    del adv, ret
    assert crf.output_cache()["cached_bytes"] == 0


def test_clear_leaves_live_outputs_alone(cache):
    adv, ret = _gae(T_BIG)
    want = adv.clone()
    crf.output_cache(clear=True)
    _gae(T_BIG, seed=3)
    torch.testing.assert_close(adv, want, rtol=0, atol=0)


def test_outputs_are_ordinary_tensors(cache):
    adv, _ = _gae(T_BIG)
    assert adv.device.type == "cpu" and adv.is_contiguous()
    adv.resize_(2 * T_BIG)  # storage from an allocator: resizable
    adv.fill_(1.0)
    assert adv.sum().item() == 2 * T_BIG
    assert torch.equal(torch.load(_roundtrip(adv), weights_only=True), adv)


def _roundtrip(t):
    import io

    b = io.BytesIO()
    torch.save(t, b)
    b.seek(0)
    return b


def test_blocks_freed_on_other_threads(cache):
    outs = [_gae(T_BIG, seed=i) for i in range(4)]
    threads = [threading.Thread(target=outs.pop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert crf.output_cache()["cached_bytes"] >= 8 * T_BIG * 4


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_limit(bad):
    with pytest.raises(ValueError, match="limit_bytes"):
        crf.output_cache(limit_bytes=bad)
