"""compute_advantages through slime's real data path and slime's real compute_advantages_and_returns, with
megatron-core's real parallel state over gloo: world 1 here; dp = 2 and cp = 2 in test_distributed.py."""
import pytest
import torch

from .conftest import skip_without_slime

skip_without_slime()

from . import _harness as H  # noqa: E402

CASES = [
    dict(),
    dict(kl_coef=0.05),
    dict(compaction_cross_segment="stitched", compaction_lam=0.9, gamma=0.99),
    dict(compaction_cross_segment="none", compaction_lam_critic=None, compaction_adaptive_length="segment"),
    dict(compaction_critic_target="corrected", kl_coef=0.1, compaction_adaptive_alpha=3.0),
]


def _gae_kw(kw):
    out = dict(gamma=kw.get("gamma", 1.0), lam=kw.get("compaction_lam", "adaptive"),
               cross_segment=kw.get("compaction_cross_segment", "paper"),
               lam_critic=kw.get("compaction_lam_critic", 1.0),
               adaptive_alpha=kw.get("compaction_adaptive_alpha", 1.5),
               adaptive_length=kw.get("compaction_adaptive_length", "rollout"))
    return out


@pytest.fixture(scope="module")
def world1():
    import torch.distributed as dist

    ps = H.init_parallel(0, 1, H.free_port())
    yield ps
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _run(samples, inputs, **kw):
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    args = H.slime_args(**kw)
    refs = H.train_data(samples, args, 1)
    rd = H.add_token_inputs(H.rank_data(refs, args, 0, 1), inputs)
    compute_advantages_and_returns(args, rd)
    return rd


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "paper")
def test_world1_matches_packed_gae_and_reference(world1, kw):
    rollouts = H.random_rollouts(12, seed=len(kw), long_segment=3000)
    samples = H.samples_of(rollouts, shuffle_seed=1)  # list order is not segment order
    inputs = H.token_inputs(samples, seed=2)
    rd = _run(samples, inputs, **kw)
    gae = _gae_kw(kw)
    target = kw.get("compaction_critic_target", "local")
    exp32 = H.expected(rollouts, samples, inputs, kl_coef=kw.get("kl_coef", 0.0), critic_target=target, **gae)
    exp64 = H.expected(rollouts, samples, inputs, kl_coef=kw.get("kl_coef", 0.0), critic_target=target,
                       dtype="float64", **gae)
    assert len(rd["advantages"]) == len(samples)
    for i, p in enumerate(rd["partition"]):
        adv, ret = rd["advantages"][i], rd["returns"][i]
        assert adv.dtype == torch.float32 and adv.shape == (samples[p].response_length,)
        torch.testing.assert_close(adv.double(), exp32[p][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ret.double(), exp32[p][1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(adv.double(), exp64[p][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret.double(), exp64[p][1], rtol=1e-5, atol=1e-5)


def test_reward_once_per_rollout_and_observations_skipped(world1):
    """Hand-made: one rollout, an exec window whose response ends with an observation, then a summary.
    slime's ppo path would add the reward to the observation token; here it lands on the last trainable
    token of each segment, and observations get 0."""
    from slime.utils.types import Sample

    from compactionrl_fast.integrations.slime import samples_from_rollout
    from compactionrl_fast.rollout.records import Rollout, Segment

    segs = [Segment("exec", [1, 2, 3, 4, 5, 6], [False, True, True, False, True, False], [0.0] * 6),
            Segment("summary", [1, 7, 8], [False, True, True], [0.0] * 3)]
    samples = samples_from_rollout(Rollout(segments=segs, reward=2.0), Sample(index=0))
    zeros = [(torch.zeros(s.response_length),) * 3 for s in samples]
    rd = _run(samples, zeros, compaction_lam=1.0)
    by_seg = {samples[p].metadata["round_number"]: rd["advantages"][i] for i, p in enumerate(rd["partition"])}
    # lam = gamma = 1, values 0: every trainable token's advantage is the reward; observations 0
    assert by_seg[0].tolist() == [2.0, 2.0, 0.0, 2.0, 0.0]
    assert by_seg[1].tolist() == [2.0, 2.0]


def test_empty_segments_with_allow(world1):
    rollouts = H.random_rollouts(10, seed=7, allow_empty=True)
    assert any(s.num_trainable == 0 for ro in rollouts for s in ro.segments)
    samples = H.samples_of(rollouts)
    inputs = H.token_inputs(samples, seed=3)
    with pytest.raises(ValueError, match="no trainable token.*compaction_untrainable"):
        _run(samples, inputs)
    rd = _run(samples, inputs, compaction_untrainable="allow")
    exp = H.expected(rollouts, samples, inputs, dtype="float64", **_gae_kw({}))
    for i, p in enumerate(rd["partition"]):
        torch.testing.assert_close(rd["advantages"][i].double(), exp[p][0], rtol=1e-5, atol=1e-5)


def test_normalize_advantages_still_works(world1):
    rollouts = H.random_rollouts(8, seed=11)
    samples = H.samples_of(rollouts)
    inputs = H.token_inputs(samples, seed=4)
    rd = _run(samples, inputs, normalize_advantages=True)
    adv = torch.cat(rd["advantages"])
    mask = torch.cat([m.bool() for m in rd["loss_masks"]])
    assert abs(float(adv[mask].mean())) < 1e-5
    assert abs(float(adv[mask].std()) - 1.0) < 1e-2


def _bad(samples, how):
    if how == "reward":
        samples[1].reward = samples[0].reward + 1.0
    elif how == "repeat":
        samples[1].metadata = dict(samples[1].metadata, round_number=0)
    elif how == "missing":
        samples[1].metadata = dict(samples[1].metadata, round_number=5)
    elif how == "no_index":
        for s in samples[:2]:
            s.metadata = {k: v for k, v in s.metadata.items() if k != "round_number"}
    return samples


@pytest.mark.parametrize("how,match", [("reward", "disagree on the reward"), ("repeat", "repeats or is missing"),
                                       ("missing", "repeats or is missing"), ("no_index", "no segment index")])
def test_bad_rollouts_raise(world1, how, match):
    from slime.utils.types import Sample

    from compactionrl_fast.integrations.slime import samples_from_rollout

    ro = H.random_rollouts(1, seed=3)[0]
    while len(ro.segments) < 2:
        ro.segments.append(ro.segments[0])
    samples = _bad(samples_from_rollout(ro, Sample(index=0)), how)
    if how == "no_index":  # slime reads round_number only when the first sample has it
        samples = samples[:2]
    inputs = [(torch.zeros(s.response_length),) * 3 for s in samples]
    with pytest.raises(ValueError, match=match):
        _run(samples, inputs)


def test_bad_lengths_and_options_raise(world1):
    from compactionrl_fast.integrations.slime import compute_advantages

    samples = H.samples_of(H.random_rollouts(3, seed=5))
    inputs = H.token_inputs(samples, seed=1)
    args = H.slime_args()
    rd = H.add_token_inputs(H.rank_data(H.train_data(samples, args, 1), args, 0, 1), inputs)
    rd["kl"] = [torch.zeros_like(v) for v in rd["values"]]
    good = {k: list(v) if isinstance(v, list) else v for k, v in rd.items()}
    rd["values"][0] = torch.zeros(rd["response_lengths"][0] + 1)
    with pytest.raises(ValueError, match="values has .* expected"):
        compute_advantages(args, rd)
    rd = dict(good, loss_masks=[torch.ones(2, dtype=torch.int32)] + good["loss_masks"][1:])
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        compute_advantages(args, rd)
    with pytest.raises(ValueError, match="--partial-rollout"):
        compute_advantages(H.slime_args(partial_rollout=True), dict(good))
    with pytest.raises(ValueError, match="compaction_cross_segment"):
        compute_advantages(H.slime_args(compaction_cross_segment="glued"), dict(good))
    with pytest.raises(ValueError, match="compaction_critic_target"):
        compute_advantages(H.slime_args(compaction_critic_target="both"), dict(good))
    # every bad option value is a ValueError naming its key (a misspelt choice included, not a TypeError)
    for key, bad in (("compaction_lam", [0.9]), ("compaction_lam", "adaptiv"), ("compaction_lam", "Adaptive"),
                     ("compaction_lam", 1.5), ("compaction_lam_critic", "one"), ("compaction_adaptive_alpha", 0),
                     ("gamma", "high")):
        with pytest.raises(ValueError, match=key):
            compute_advantages(H.slime_args(**{key: bad}), dict(good))
    old = {k: v for k, v in good.items() if k != "rollout_ids"}
    with pytest.raises(ValueError, match="lacks the hooks"):
        compute_advantages(args, old)


# ------------------------------------------------------------ the fast paths against the full ones
# compute_advantages skips _check_rollouts when _plainly_valid says the batch passes it (one rank), and keeps
# list order when the samples are in rollout/segment order already (Rows.order() is None). Each shortcut is
# run here against its full twin, forced by monkeypatch, on valid and broken batches: same error or the
# same numbers bit for bit.


def _permuted(rd, perm):
    n = len(rd["loss_masks"])
    return {k: [v[i] for i in perm] if isinstance(v, list) and len(v) == n else v for k, v in rd.items()}


def _broken(rd, rng):
    """rollout_data with one random defect (or none), a permutation of its samples, and the case's name."""
    rd = dict(rd)
    n = len(rd["loss_masks"])
    i, j = rng.randrange(n), rng.randrange(n)
    how = rng.choice(["none", "none", "reward", "repeat", "shift", "gap", "move", "untrainable", "no_index"])
    col = {k: list(rd[k]) for k in ("rewards", "round_number", "rollout_ids", "loss_masks")}
    if how == "reward":
        col["rewards"][i] += 0.5
    elif how == "repeat":  # an index of another sample of the same rollout, if it has one
        col["round_number"][i] = col["round_number"][next((k for k in range(n) if k != i and
                                                          col["rollout_ids"][k] == col["rollout_ids"][i]), i)]
    elif how == "shift":  # 1..n instead of 0..n-1: complete and distinct, but not from 0
        col["round_number"] = [s + (r == col["rollout_ids"][i]) for s, r in zip(col["round_number"],
                                                                                 col["rollout_ids"])]
    elif how == "gap":
        col["round_number"][i] += rng.choice([1, 2, 5])
    elif how == "move":  # a segment handed to another rollout (same or different reward)
        col["rollout_ids"][i] = col["rollout_ids"][j]
    elif how == "untrainable":
        col["loss_masks"][i] = torch.zeros_like(col["loss_masks"][i])
    rd.update(col)
    if how == "no_index":
        del rd["round_number"]
    perm = list(range(n))
    shuffle = rng.choice(["none", "none", "all", "swap"])
    if shuffle == "all":
        rng.shuffle(perm)
    elif shuffle == "swap" and n > 1:
        perm[i], perm[(i + 1) % n] = perm[(i + 1) % n], perm[i]
    return rd, perm, f"{how}, shuffle {shuffle}"


def _outcome(args, rd):
    from compactionrl_fast.integrations.slime import compute_advantages

    rd = dict(rd)
    try:
        compute_advantages(args, rd)
    except ValueError as e:
        return str(e)
    return list(zip(rd["advantages"], rd["returns"]))


def test_fast_paths_match_the_full_ones(world1, monkeypatch):
    import random

    from compactionrl_fast.integrations.slime import advantages as A

    rng = random.Random(0)
    taken = {"plainly valid": 0, "in order": 0, "error": 0, "ok": 0}
    plainly, order = A._plainly_valid, A._Rows.order

    def spy(*a):
        ok = plainly(*a)
        taken["plainly valid"] += ok
        return ok

    for seed in range(6):
        samples = H.samples_of(H.random_rollouts(5, seed=seed, allow_empty=seed % 2 == 1))
        inputs = H.token_inputs(samples, seed=seed)
        args = H.slime_args(kl_coef=0.05, compaction_untrainable="allow" if seed % 3 == 2 else "error")
        base = H.add_token_inputs(H.rank_data(H.train_data(samples, args, 1), args, 0, 1), inputs)
        base["kl"] = [lp - ref for lp, ref in zip(base["log_probs"], base["ref_log_probs"])]
        for trial in range(15):
            rd0, perm, case = _broken(base, rng)
            rd = _permuted(rd0, perm)
            monkeypatch.setattr(A, "_plainly_valid", spy)
            monkeypatch.setattr(A._Rows, "order", order)
            taken["in order"] += order(A._columns(rd, 1)[0]) is None
            fast = _outcome(args, rd)
            monkeypatch.setattr(A, "_plainly_valid", lambda *a: False)  # always _check_rollouts
            full = _outcome(args, rd)
            monkeypatch.setattr(A._Rows, "order", lambda self: order(self) or list(range(len(self))))
            unordered = _outcome(args, rd)  # and never the list-order packing and unpacking
            for other in (full, unordered):
                assert type(fast) is type(other), (case, fast if isinstance(fast, str) else other)
                if isinstance(fast, str):
                    assert fast == other, case
                else:
                    assert len(fast) == len(other) and all(torch.equal(a, b) and torch.equal(r, s)
                                                           for (a, r), (b, s) in zip(fast, other)), case
            if not isinstance(fast, str):  # the samples' own numbers, whatever their list order
                plain = _outcome(args, rd0)
                assert not isinstance(plain, str), (case, plain)
                assert all(torch.equal(a, plain[p][0]) and torch.equal(r, plain[p][1])
                           for (a, r), p in zip(fast, perm)), case
            taken["error" if isinstance(fast, str) else "ok"] += 1
    # every branch was taken, so that the comparisons above mean something
    assert min(taken.values()) >= 10, taken
