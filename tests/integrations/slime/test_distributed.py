"""compute_advantages on 2 and 4 processes (gloo, megatron-core's real parallel state): dp = 2 with rollouts whose
segments land on both ranks, cp = 2 (values, log-probs and KL as CP-local slices), and dp = 2 x cp = 2: each
equal to the numbers of one rank (the packed batch of the Rollout records)."""
import pytest
import torch

from .conftest import skip_without_slime

skip_without_slime()

from . import _harness as H  # noqa: E402


_spawn = H.spawn


@pytest.mark.slow
def test_dp2_split_rollouts_equal_one_rank():
    rollouts = H.random_rollouts(10, seed=21, long_segment=500)
    samples = H.samples_of(rollouts, shuffle_seed=3)
    inputs = H.token_inputs(samples, seed=5)
    kw = dict(kl_coef=0.05)
    res = _spawn(2, 1, samples, inputs, kw)
    assert all("error" not in r for r in res), res
    assert H.split_rollouts([out["partition"] for out in res], samples), "the split must put a rollout on both ranks"
    exp = H.expected(rollouts, samples, inputs, kl_coef=0.05, dtype="float64", gamma=1.0, lam="adaptive")
    seen = set()
    for out in res:
        for i, p in enumerate(out["partition"]):
            seen.add(p)
            torch.testing.assert_close(out["advantages"][i].double(), exp[p][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out["returns"][i].double(), exp[p][1], rtol=1e-5, atol=1e-5)
    assert seen == set(range(len(samples)))


@pytest.mark.slow
def test_dp2_bad_input_raises_on_every_rank():
    samples = H.samples_of(H.random_rollouts(6, seed=2))
    two = next(s for s in samples if s.metadata["round_number"] == 1)
    two.reward += 1.0  # this rollout's segments now disagree on the reward
    # first-fit packing into micro-batches of at most 512 tokens, as --use-dynamic-batch-size does
    res = _spawn(2, 1, samples, H.token_inputs(samples, seed=1),
                 dict(use_dynamic_batch_size=True, max_tokens_per_gpu=512))
    assert all("disagree on the reward" in r.get("error", "") for r in res), res


@pytest.mark.slow
@pytest.mark.parametrize("world, bad_rank", [(2, 1), (4, 2)], ids=["cp2", "dp2xcp2"])
def test_cp_rank_bad_values_raise_on_every_rank(world, bad_rank):
    """`values` of the wrong length on one CP rank only: every rank raises the same ValueError, none is left
    waiting in all_gather_with_cp (each rank's collectives time out after 60 s, which fails the test)."""
    samples = H.samples_of(H.random_rollouts(6, seed=12))
    res = _spawn(world, 2, samples, H.token_inputs(samples, seed=3), dict(kl_coef=0.05), bad_values_rank=bad_rank)
    errors = {r.get("error") for r in res}
    assert len(errors) == 1 and "values has" in errors.pop(), res


@pytest.mark.slow
def test_cp2_equals_one_rank():
    rollouts = H.random_rollouts(6, seed=31) + [H.prompt_heavy_rollout()]
    samples = H.samples_of(rollouts, shuffle_seed=2)
    inputs = H.token_inputs(samples, seed=6)
    kw = dict(kl_coef=0.1, compaction_cross_segment="stitched")
    res = _spawn(2, 2, samples, inputs, kw)
    assert all("error" not in r for r in res), res
    heavy = next(i for i, p in enumerate(res[0]["partition"]) if samples[p].rollout_id == len(rollouts) - 1)
    assert res[0]["advantages"][heavy].numel() == 0 < res[1]["advantages"][heavy].numel()  # CP rank 0 holds none
    exp = H.expected(rollouts, samples, inputs, kl_coef=0.1, dtype="float64", gamma=1.0, lam="adaptive",
                     cross_segment="stitched")
    # each CP rank holds two zigzag chunks of every response: put them back together and compare
    for i, p in enumerate(res[0]["partition"]):
        n, t = res[0]["response_lengths"][i], res[0]["total_lengths"][i]
        full = _unslice([r["advantages"][i] for r in res], t, n)
        torch.testing.assert_close(full.double(), exp[p][0], rtol=1e-5, atol=1e-5)
        full = _unslice([r["returns"][i] for r in res], t, n)
        torch.testing.assert_close(full.double(), exp[p][1], rtol=1e-5, atol=1e-5)


def _unslice(parts, total, resp):
    """The response [resp] from each CP rank's slice, by slicing an index vector the same way."""
    import slime.backends.megatron_utils.cp_utils as cp
    from megatron.core import mpu

    out = torch.full((resp,), float("nan"))
    idx = torch.arange(resp, dtype=torch.float64)
    saved = mpu.get_context_parallel_world_size, mpu.get_context_parallel_rank
    try:
        for rank, part in enumerate(parts):
            mpu.get_context_parallel_world_size, mpu.get_context_parallel_rank = (lambda: 2), (lambda r=rank: r)
            pos = cp.slice_log_prob_with_cp(idx, total, resp).long()
            out[pos] = part.float()
    finally:
        mpu.get_context_parallel_world_size, mpu.get_context_parallel_rank = saved
    assert not out.isnan().any(), "the CP slices must cover the whole response"
    return out


@pytest.mark.slow
def test_dp2_cp2_equals_one_rank():
    rollouts = H.random_rollouts(8, seed=41) + [H.prompt_heavy_rollout()]
    samples = H.samples_of(rollouts, shuffle_seed=4)
    inputs = H.token_inputs(samples, seed=8)
    res = _spawn(4, 2, samples, inputs, dict(kl_coef=0.05, use_dynamic_batch_size=True, max_tokens_per_gpu=96))
    assert all("error" not in r for r in res), res
    exp = H.expected(rollouts, samples, inputs, kl_coef=0.05, dtype="float64", gamma=1.0, lam="adaptive")
    seen = set()
    for dp in range(2):  # ranks 2*dp and 2*dp+1 are the CP pair of DP rank dp (no TP/PP)
        a, b = res[2 * dp], res[2 * dp + 1]
        assert a["partition"] == b["partition"]
        for i, p in enumerate(a["partition"]):
            seen.add(p)
            n, t = a["response_lengths"][i], a["total_lengths"][i]
            full = _unslice([a["advantages"][i], b["advantages"][i]], t, n)
            torch.testing.assert_close(full.double(), exp[p][0], rtol=1e-5, atol=1e-5)
    assert seen == set(range(len(samples)))
    assert H.split_rollouts([res[2 * dp]["partition"] for dp in range(2)], samples), \
        "the split must put a rollout on both DP ranks"
