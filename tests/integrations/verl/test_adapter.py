"""verl adapter: `compaction_gae` and the `compaction` policy loss.

On one-segment batches they equal verl's own GAE (compute_gae_advantage_return) and "vanilla" policy
loss on trainable tokens (restated in tests/integrations/peers.py, and the real ones where verl
imports); on compacted batches they equal the packed ops. The tests against the real verl run where it
is importable (`make test-integrations` installs it); elsewhere they skip with the reason.
"""
import os
import subprocess
import sys
import types

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.integrations import verl as V
from tests.integrations import peers
from tests.integrations._batches import multiturn_rows, padded_from_packed
from tests.utils import SHAPE_TABLE, packed_batch, random_case

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
VERL_REASON = "verl is not importable (it needs ray and tensordict; `make test-integrations` installs them)"


def _one_segment_batch(seed=0, B=9, L=70):
    g = torch.Generator().manual_seed(seed)
    mask = multiturn_rows(B, L, seed=seed)
    r = torch.randn(B, L, generator=g) * (torch.rand(B, L, generator=g) < 0.2)
    v = torch.randn(B, L, generator=g)
    return r, v, mask.long()  # verl keeps integer masks


def _gae_config(**sub):
    return {"gamma": sub.pop("gamma", 1.0), "compaction_gae": sub}


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0)])
def test_gae_equals_verl_gae_on_one_segment_batches(gamma, lam):
    r, v, mask = _one_segment_batch()
    want_adv, want_ret = peers.verl_gae(r, v, mask, gamma, lam)
    adv, ret = V.compute_compaction_gae(r, mask, values=v, config=_gae_config(gamma=gamma, lam=lam, lam_critic=None,
                                                                               whiten=True))
    m = mask.bool()
    torch.testing.assert_close(adv[m].double(), want_adv[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret[m].double(), want_ret[m], rtol=1e-5, atol=1e-5)
    assert not adv[~m].any()


@pytest.mark.parametrize("mode", ["paper", "stitched"])
@pytest.mark.parametrize("case", ["four_segments", "empty_segments", "random"])
def test_gae_on_compacted_batches_equals_packed_op(case, mode):
    b = packed_batch(random_case(4, n_rollouts=6, max_len=150) if case == "random" else SHAPE_TABLE[case], seed=2)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=5)
    cfg = _gae_config(gamma=0.99, cross_segment=mode)  # lam="adaptive", lam_critic=1.0: package defaults
    # rows of one rollout share the uid (verl's `index`); chronological positions come as segment_index
    adv, ret = V.compute_compaction_gae(pad["rewards"], pad["mask"].float(), values=pad["values"],
                                        index=ids.numpy().astype(object), config=cfg, segment_index=pos)
    want_adv, want_ret = crf.segment_gae(**b, gamma=0.99, cross_segment=mode)
    torch.testing.assert_close(adv[rows, cols], want_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret[rows, cols], want_ret, rtol=1e-6, atol=1e-6)


def test_gae_needs_values_and_explains():
    r, v, mask = _one_segment_batch()
    with pytest.raises(ValueError, match="values"):
        V.compute_compaction_gae(r, mask, index=None, config=None)


def test_gae_options_read_every_config_kind():
    cfg = {"gamma": 0.9, "compaction_gae": {"lam": 0.5, "lam_critic": None, "cross_segment": "none"}}
    kw, flags = V.gae_options(cfg)
    assert kw == dict(gamma=0.9, lam=0.5, lam_critic=None, cross_segment="none", adaptive_alpha=1.5,
                      adaptive_length="rollout")
    assert flags == dict(whiten=False, rollout_id_key="rollout_id", group_by_uid=True)
    kw, _ = V.gae_options(types.SimpleNamespace(gamma=1.0))  # an object without the sub-config: defaults
    assert kw["lam"] == "adaptive" and kw["lam_critic"] == 1.0


def _loss_inputs(seed=0, B=7, L=40):
    g = torch.Generator().manual_seed(seed)
    mask = multiturn_rows(B, L, seed=seed).long()
    old = torch.randn(B, L, generator=g) - 1.0
    logp = old + 0.5 * torch.randn(B, L, generator=g)
    logp[:, ::5] += 1.5  # ratios ~4.5: past the dual clip c = 3 where A < 0
    adv = torch.randn(B, L, generator=g)
    return old, logp.requires_grad_(), adv, mask


def _assert_every_clip_binds(old, logp, adv, mask, c=3.0, low=0.2, high=0.28):
    """So that an adapter dropping (or mis-passing) a clip changes the loss: trainable tokens exist on the
    upper clip (A > 0), the lower clip (A < 0) and the dual clip (A < 0, ratio > c)."""
    r, on = (logp.detach() - old).exp(), mask.bool()
    assert ((adv > 0) & (r > 1 + high) & on).sum() >= 3
    assert ((adv < 0) & (r < 1 - low) & on).sum() >= 3
    assert ((adv < 0) & (r > c) & on).sum() >= 3


def _actor_config(**kw):
    base = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info={},
                loss_scale_factor=None)
    base.update(kw)
    return base


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("gbi", [{}, {"dp_size": 2, "batch_num_tokens": 300, "global_batch_size": 11}])
def test_policy_loss_equals_verl_vanilla(mode, gbi):
    old, logp, adv, mask = _loss_inputs()
    _assert_every_clip_binds(old, logp, adv, mask)
    w = torch.rand(mask.shape) * 2  # rollout-correction weights
    w[0, :5] = 0.0
    cfg = _actor_config(global_batch_info=gbi)
    loss, metrics = V.compute_policy_loss_compaction(old, logp, adv, mask, mode, cfg, rollout_is_weights=w)
    (g,) = torch.autograd.grad(loss, logp)
    want, clipfrac, lower = peers.verl_policy_loss(old, logp, adv, mask, mode, 0.2, 0.28, 3.0, weights=w, **gbi)
    (wg,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g.double(), wg.double(), rtol=1e-5, atol=1e-8)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(clipfrac), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(float(lower), abs=1e-6)
    k1 = float(((old - logp.detach()) * mask).sum() / mask.sum())
    assert metrics["actor/ppo_kl"] == pytest.approx(k1, rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("gbi", [{}, {"dp_size": 2, "batch_num_tokens": 300, "global_batch_size": 11}])
def test_policy_loss_same_bits_for_every_mask_dtype(mode, gbi):
    """An int or float mask (converted and counted in one pass; its count is the token-mean denominator
    when verl gives none) gives the bool mask's loss, gradient and metrics bit for bit; a value other than
    0 and 1 is refused."""
    old, logp, adv, mask = _loss_inputs()
    cfg = _actor_config(global_batch_info=gbi)
    runs = []
    for m in (mask.bool(), mask.long(), mask.int(), mask.float(), mask.double()):
        x = logp.detach().clone().requires_grad_()
        loss, metrics = V.compute_policy_loss_compaction(old, x, adv, m, mode, cfg)
        loss.backward()
        runs.append((loss, x.grad, metrics))
    for loss, grad, metrics in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and torch.equal(grad, runs[0][1]) and metrics == runs[0][2]
    bad = mask.float()
    bad[1, 3] = 0.5
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        V.compute_policy_loss_compaction(old, logp, adv, bad, mode, cfg)


def test_policy_loss_fully_masked_is_zero():
    old, logp, adv, mask = _loss_inputs()
    loss, metrics = V.compute_policy_loss_compaction(old, logp, adv, torch.zeros_like(mask), "token-mean",
                                                     _actor_config())
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0 and not g.any() and metrics["actor/pg_clipfrac"] == 0.0


def test_policy_loss_bad_mode_and_missing_global_counts():
    old, logp, adv, mask = _loss_inputs()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        V.compute_policy_loss_compaction(old, logp, adv, mask, "seq-mean", _actor_config())
    with pytest.raises(ValueError, match="batch_num_tokens"):
        V.compute_policy_loss_compaction(old, logp, adv, mask, "token-mean",
                                         _actor_config(global_batch_info={"dp_size": 2}))


def test_compute_advantage_on_a_dataproto_like_object():
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=3)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=1)
    data = types.SimpleNamespace(batch={"token_level_rewards": pad["rewards"], "values": pad["values"],
                                        "response_mask": pad["mask"].long()},
                                 non_tensor_batch={"rollout_id": ids.numpy(), "uid": list(range(len(ids))),
                                                   "segment_index": pos.numpy()})
    V.compute_advantage(data, {"gamma": 1.0})
    want_adv, want_ret = crf.segment_gae(**b)
    torch.testing.assert_close(data.batch["advantages"][rows, cols], want_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(data.batch["returns"][rows, cols], want_ret, rtol=1e-6, atol=1e-6)


def test_patch_compute_advantage_routes_only_compaction_gae():
    calls = []

    def original(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1, norm_adv_by_std_in_grpo=True, config=None):
        calls.append(adv_estimator)
        return data

    mod = types.SimpleNamespace(compute_advantage=original)
    assert V.patch_compute_advantage(mod) == [mod]
    assert V.patch_compute_advantage(mod) == []  # idempotent
    r, v, mask = _one_segment_batch()
    data = types.SimpleNamespace(batch={"token_level_rewards": r, "values": v, "response_mask": mask},
                                 non_tensor_batch={})
    mod.compute_advantage(data, adv_estimator="gae", gamma=1.0, lam=1.0, config={})
    assert calls == ["gae"] and "advantages" not in data.batch
    mod.compute_advantage(data, adv_estimator="compaction_gae", gamma=1.0, lam=1.0, config={"gamma": 0.9})
    assert calls == ["gae"]
    want, _ = crf.segment_gae(*(x[mask.bool()] for x in (r, v)), torch.ones(int(mask.sum()), dtype=torch.bool),
                              torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]), gamma=0.9)
    torch.testing.assert_close(data.batch["advantages"][mask.bool()], want)


# ---------------------------------------------------------------- against the real verl


@pytest.fixture(scope="module")
def core_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_REASON)


def test_registered_in_verl(core_algos):
    assert V.REGISTERED
    assert core_algos.get_adv_estimator_fn("compaction_gae") is V.compute_compaction_gae
    assert core_algos.get_policy_loss_fn("compaction") is V.compute_policy_loss_compaction


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9)])
def test_restated_gae_equals_real_verl(core_algos, gamma, lam):
    r, v, mask = _one_segment_batch(seed=3)
    adv, ret = core_algos.compute_gae_advantage_return(r.double(), v.double(), mask.double(), gamma, lam)
    want_adv, want_ret = peers.verl_gae(r, v, mask, gamma, lam)
    m = mask.bool()
    torch.testing.assert_close(adv[m], want_adv[m], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret[m], want_ret[m], rtol=1e-9, atol=1e-9)
    ours, _ = V.compute_compaction_gae(r, mask, values=v, config=_gae_config(gamma=gamma, lam=lam, whiten=True))
    torch.testing.assert_close(ours[m].double(), adv[m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_equals_real_verl_vanilla(core_algos, mode):
    from verl.workers.config import ActorConfig

    old, logp, adv, mask = _loss_inputs(seed=4)
    _assert_every_clip_binds(old, logp, adv, mask)
    w = torch.rand(mask.shape) * 2
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28)
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=250, global_batch_size=9)
    real, real_m = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, mode, cfg, rollout_is_weights=w)
    (rg,) = torch.autograd.grad(real, logp)
    fn = core_algos.get_policy_loss_fn("compaction")
    ours, m = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=mode, config=cfg,
                 rollout_is_weights=w)
    (g,) = torch.autograd.grad(ours, logp)
    torch.testing.assert_close(ours, real, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-8)
    for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        assert m[k] == pytest.approx(real_m[k], rel=1e-5, abs=1e-7), k
    want, _, _ = peers.verl_policy_loss(old, logp, adv, mask, mode, 0.2, 0.28, 3.0, weights=w, dp_size=2,
                                        batch_num_tokens=250, global_batch_size=9)
    torch.testing.assert_close(real.double(), want, rtol=1e-5, atol=1e-7)


def test_compute_advantage_with_real_dataproto(core_algos):
    import numpy as np
    from verl import DataProto

    b = packed_batch(SHAPE_TABLE["four_segments"], seed=6)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=2)
    data = DataProto.from_dict(tensors={"token_level_rewards": pad["rewards"], "values": pad["values"],
                                        "response_mask": pad["mask"].long()},
                               non_tensors={"uid": np.array([f"u{i}" for i in ids.tolist()], dtype=object),
                                            "segment_index": pos.numpy()})
    V.compute_advantage(data, {"gamma": 1.0})  # no rollout_id key: rows sharing a uid are one rollout
    want_adv, _ = crf.segment_gae(**b)
    torch.testing.assert_close(data.batch["advantages"][rows, cols], want_adv, rtol=1e-6, atol=1e-6)


def test_verl_loads_the_adapter_from_its_env_variable(core_algos):
    code = ("import verl.trainer.ppo.core_algos as c; "
            "print(c.ADV_ESTIMATOR_REGISTRY['compaction_gae'].__module__, "
            "c.POLICY_LOSS_REGISTRY['compaction'].__name__)")
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="compactionrl_fast.integrations.verl")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["compactionrl_fast.integrations.verl.adapter", "compute_policy_loss_compaction"]


def test_patch_real_verl_compute_advantage(core_algos):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer",
                             reason="verl's ray_trainer needs more packages (torchdata, datasets, fastapi, ...)")
    import numpy as np
    from omegaconf import OmegaConf
    from verl import DataProto

    b = packed_batch(SHAPE_TABLE["four_segments"], seed=9)
    pad, ids, pos, rows, cols = padded_from_packed(b, shuffle=False)
    data = DataProto.from_dict(tensors={"token_level_rewards": pad["rewards"], "values": pad["values"],
                                        "response_mask": pad["mask"].long()},
                               non_tensors={"uid": np.array([f"u{i}" for i in ids.tolist()], dtype=object)})
    cfg = OmegaConf.create({"gamma": 1.0, "lam": 1.0, "adv_estimator": "compaction_gae",
                            "compaction_gae": {"cross_segment": "stitched"}})
    original = rt.compute_advantage
    try:
        assert V.patch_compute_advantage(rt) == [rt]
        out = rt.compute_advantage(data, adv_estimator="compaction_gae", gamma=1.0, lam=1.0, num_repeat=1,
                                   norm_adv_by_std_in_grpo=True, config=cfg)
        want_adv, want_ret = crf.segment_gae(**b, cross_segment="stitched")
        torch.testing.assert_close(out.batch["advantages"][rows, cols], want_adv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.batch["returns"][rows, cols], want_ret, rtol=1e-6, atol=1e-6)
        gae = rt.compute_advantage(data, adv_estimator="gae", gamma=1.0, lam=0.9, config=OmegaConf.create({}))
        want, _ = core_algos.compute_gae_advantage_return(pad["rewards"], pad["values"], pad["mask"].long(), 1.0, 0.9)
        torch.testing.assert_close(gae.batch["advantages"], want)  # other estimators: verl's own function
    finally:
        rt.compute_advantage = original


# ---------------------------------------------------------------- defaults, config keys, names (mutation testing)


def test_policy_loss_defaults_and_clip_keys():
    """No config: verl's defaults (clip 0.2 both sides, dual clip 3, token-mean); clip_ratio_low/high
    override clip_ratio side by side; loss_scale_factor replaces L in the -norm mode."""
    old, logp, adv, mask = _loss_inputs()
    _assert_every_clip_binds(old, logp, adv, mask, low=0.2, high=0.2)
    _assert_every_clip_binds(old, logp, adv, mask, low=0.1, high=0.3)
    want = lambda low, high, mode="token-mean": peers.verl_policy_loss(old, logp, adv, mask, mode, low, high, 3.0)[0]
    cases = [(None, want(0.2, 0.2)), ({}, want(0.2, 0.2)), ({"clip_ratio": 0.3}, want(0.3, 0.3)),
             ({"clip_ratio": 0.3, "clip_ratio_low": 0.1}, want(0.1, 0.3)),
             ({"clip_ratio": 0.1, "clip_ratio_high": 0.3}, want(0.1, 0.3))]
    for cfg, w in cases:
        loss, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, config=cfg)
        torch.testing.assert_close(loss.double(), w, rtol=1e-5, atol=1e-7)
    loss, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, "token-mean", {"clip_ratio_c": 4.0})
    w = peers.verl_policy_loss(old, logp, adv, mask, "token-mean", 0.2, 0.2, 4.0)[0]
    torch.testing.assert_close(loss.double(), w, rtol=1e-5, atol=1e-7)
    L = mask.shape[1]
    base, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, "seq-mean-token-sum-norm", {})
    scaled, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, "seq-mean-token-sum-norm",
                                                 {"loss_scale_factor": 7.0})
    torch.testing.assert_close(scaled, base * L / 7.0)


def test_policy_loss_metrics():
    old, logp, adv, mask = _loss_inputs()
    _, metrics = V.compute_policy_loss_compaction(old, logp, adv, mask, "token-mean", _actor_config())
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/approx_kl",
                            "actor/ratio_max"}
    lr, m = (logp.detach() - old).double(), mask.bool()
    assert metrics["actor/ratio_max"] == pytest.approx(float(lr[m].exp().max()), rel=1e-5)
    assert metrics["actor/approx_kl"] == pytest.approx(float((lr[m].exp() - 1 - lr[m]).mean()), rel=1e-5)


def test_policy_loss_global_batch_info_edge_cases():
    old, logp, adv, mask = _loss_inputs()
    cfg = _actor_config
    base, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, "token-mean", cfg())
    none_dp, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, "token-mean",
                                                  cfg(global_batch_info={"dp_size": None}))
    torch.testing.assert_close(none_dp, base)  # dp_size None: one rank
    one, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, "token-sum", cfg())
    two, _ = V.compute_policy_loss_compaction(old, logp, adv, mask, "token-sum", cfg(global_batch_info={"dp_size": 2}))
    torch.testing.assert_close(two, one * 2)  # token-sum needs no global counts
    with pytest.raises(ValueError, match=r"global_batch_info\['batch_num_tokens'\] is required"):
        V.compute_policy_loss_compaction(old, logp, adv, mask, "token-mean", cfg(global_batch_info={"dp_size": 2}))
    with pytest.raises(ValueError, match=r"global_batch_info\['global_batch_size'\] is required"):
        V.compute_policy_loss_compaction(old, logp, adv, mask, "seq-mean-token-mean",
                                         cfg(global_batch_info={"dp_size": 2}))


def test_adapter_errors_name_the_argument():
    old, logp, adv, mask = _loss_inputs()
    bad = torch.zeros(3, 2)
    args = dict(old_log_prob=old, log_prob=logp, advantages=adv, rollout_is_weights=torch.ones(mask.shape))
    for name in args:
        kw = dict(args, **{name: bad})
        with pytest.raises(ValueError, match=rf"^{name} must have shape \[B, L\]"):
            V.compute_policy_loss_compaction(response_mask=mask, **kw)
    with pytest.raises(ValueError, match="^response_mask must hold only 0 and 1"):
        V.compute_policy_loss_compaction(old, logp, adv, mask * 2)
    r, v, m = _one_segment_batch()
    with pytest.raises(ValueError, match="^response_mask must hold only 0 and 1"):
        V.compute_compaction_gae(r, m * 2, values=v)
    with pytest.raises(ValueError, match=r"^compaction_gae needs the critic's values.*patch_compute_advantage\(\) "
                                         r"\(and set critic.enable=True\)$"):
        V.compute_compaction_gae(r, m)


def test_gae_options_defaults_and_lam_types():
    kw, flags = V.gae_options({})
    assert kw == dict(gamma=1.0, **V.GAE_DEFAULTS) and type(kw["gamma"]) is float
    assert flags == dict(whiten=False, rollout_id_key="rollout_id", group_by_uid=True)
    kw, flags = V.gae_options({"compaction_gae": {"lam": 1, "rollout_id_key": "rid", "group_by_uid": False}})
    assert kw["lam"] == 1.0 and type(kw["lam"]) is float and flags["rollout_id_key"] == "rid"
    assert flags["group_by_uid"] is False
    with pytest.raises(ValueError, match=r"^algorithm\.compaction_gae\.lam: "):
        V.gae_options({"compaction_gae": {"lam": True}})


def test_compute_advantage_id_sources():
    """Rollout ids from the configured key, else `uid` (unless group_by_uid is off), else one per row."""
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=3)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=1, shuffle=False)
    batch = {"token_level_rewards": pad["rewards"], "values": pad["values"], "response_mask": pad["mask"].long()}
    grouped, _ = crf.segment_gae(**b)
    per_row = V.compute_compaction_gae(pad["rewards"], pad["mask"], values=pad["values"])[0][rows, cols]
    assert not torch.allclose(grouped, per_row)

    def run(nt, cfg):
        data = types.SimpleNamespace(batch=dict(batch), **({} if nt is None else {"non_tensor_batch": nt}))
        return V.compute_advantage(data, cfg).batch["advantages"][rows, cols]

    torch.testing.assert_close(run({"rid": ids.numpy()}, {"compaction_gae": {"rollout_id_key": "rid"}}), grouped)
    torch.testing.assert_close(run({"uid": ids.numpy()}, {}), grouped)
    torch.testing.assert_close(run({"uid": ids.numpy()}, {"compaction_gae": {"group_by_uid": False}}), per_row)
    torch.testing.assert_close(run(None, {}), per_row)  # no non_tensor_batch at all


def test_patch_compute_advantage_module_names_and_call_forms(tmp_path, monkeypatch):
    calls = []

    def original(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1, norm_adv_by_std_in_grpo=True, config=None):
        calls.append((data, adv_estimator, gamma, config))
        return data

    loaded = types.ModuleType("crf_fake_loaded")
    loaded.compute_advantage = original
    monkeypatch.setitem(sys.modules, "crf_fake_loaded", loaded)
    (tmp_path / "crf_fake_on_disk.py").write_text("def compute_advantage(data, adv_estimator, config=None):\n"
                                                  "    return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "crf_fake_on_disk", raising=False)
    without = types.SimpleNamespace()
    patched = V.patch_compute_advantage("crf_no_such_module", without, "crf_fake_loaded", "crf_fake_on_disk")
    assert [getattr(m, "__name__", None) for m in patched] == ["crf_fake_loaded", "crf_fake_on_disk"]
    assert sys.modules["crf_fake_on_disk"].compute_advantage("d", "gae") == "original"
    r, v, mask = _one_segment_batch()
    data = types.SimpleNamespace(batch={"token_level_rewards": r, "values": v, "response_mask": mask},
                                 non_tensor_batch={})
    loaded.compute_advantage(data, "gae", 0.5, config={"x": 1})  # others: args and kwargs passed on unchanged
    assert calls == [(data, "gae", 0.5, {"x": 1})]
    # config given positionally; the estimator as an enum-like object with .value
    loaded.compute_advantage(data, types.SimpleNamespace(value="compaction_gae"), 1.0, 1.0, 1, True, {"gamma": 0.9})
    assert len(calls) == 1
    want, _ = crf.segment_gae(*(x[mask.bool()] for x in (r, v)), torch.ones(int(mask.sum()), dtype=torch.bool),
                              torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]), gamma=0.9)
    torch.testing.assert_close(data.batch["advantages"][mask.bool()], want)


def test_register_with_a_fake_verl(monkeypatch):
    """register() against verl's decorator API (faked: real verl runs only in `make test-integrations`)."""
    adv, loss = {}, {}

    def register_adv_est(name):
        def deco(fn):
            if name in adv and adv[name] != fn:  # as verl: a different function under a taken name
                raise ValueError(f"{name} already registered")
            adv[name] = fn
            return fn
        return deco

    def register_policy_loss(name):
        def deco(fn):
            loss[name] = fn
            return fn
        return deco

    core = types.SimpleNamespace(ADV_ESTIMATOR_REGISTRY=adv, register_adv_est=register_adv_est,
                                 register_policy_loss=register_policy_loss)
    ppo = types.ModuleType("verl.trainer.ppo")
    ppo.core_algos = core
    for name, mod in (("verl", types.ModuleType("verl")), ("verl.trainer", types.ModuleType("verl.trainer")),
                      ("verl.trainer.ppo", ppo), ("verl.trainer.ppo.core_algos", core)):
        monkeypatch.setitem(sys.modules, name, mod)
    assert V.register() is True and V.register() is True
    assert adv == {"compaction_gae": V.compute_compaction_gae}
    assert loss == {"compaction": V.compute_policy_loss_compaction}
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo", None)  # not importable
    assert V.register() is False
