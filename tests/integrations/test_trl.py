"""TRL adapter: the GAE, policy loss and value loss of TRL's PPOTrainer as functions.

TRL computes them inline in `PPOTrainer.train` (trl/experimental/ppo/ppo_trainer.py, TRL <= 1.12; 1.13
removed PPO), so there is no function to call: the tests compare with a restatement of that code
(tests/integrations/peers.py) on TRL's right-padded layout, and check the restated whitening against
TRL's own `masked_whiten` where TRL <= 1.12 imports (skipped elsewhere, with the reason). On compacted
batches the adapter equals the packed ops.
"""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.integrations import trl as T
from tests.integrations import peers
from tests.integrations._batches import padded_from_packed
from tests.utils import SHAPE_TABLE, packed_batch

REASON = "TRL's PPO trainer is not importable (removed in TRL 1.13; `make test-integrations` installs TRL 1.12)"


def _trl_batch(seed=0, L=50):
    """TRL's layout: sequence_lengths = index of the last response token (-1: empty response),
    padding_mask = idx > len, padding_mask_p1 = idx > len + 1; rewards are 0 past padding_mask_p1 (TRL's
    KL penalty is 0 there and the score sits at len + 1)."""
    g = torch.Generator().manual_seed(seed)
    seq_len = torch.tensor([-1, 0, 10, L - 1, L - 2, 33, 5])
    B = seq_len.numel()
    idx = torch.arange(L).repeat(B, 1)
    padding_mask = idx > seq_len[:, None]
    padding_mask_p1 = idx > (seq_len + 1)[:, None]
    rewards = 0.01 * torch.randn(B, L, generator=g)
    end = torch.where(seq_len + 1 < L, seq_len + 1, seq_len).clamp(min=0)
    rewards[torch.arange(B), end] += torch.randn(B, generator=g)
    rewards = torch.where(padding_mask_p1, 0.0, rewards)
    values = torch.randn(B, L, generator=g)
    return rewards, values, padding_mask, padding_mask_p1, g


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0)])
def test_gae_equals_trl_on_one_segment_batches(gamma, lam):
    rewards, values, pm, pm1, _ = _trl_batch()
    adv, ret = T.compute_advantages(rewards, values, pm, pm1, gamma, lam)
    want_adv, want_ret = peers.trl_gae(rewards, values, pm, pm1, gamma, lam)
    torch.testing.assert_close(adv.double(), want_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), want_ret, rtol=1e-5, atol=1e-5)


def test_gae_on_compacted_batches_equals_packed_op():
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=8)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=3)
    pm = ~pad["mask"]  # TRL's masks say "padding"; here they carry observation holes too
    adv, ret = T.compute_advantages(pad["rewards"], pad["values"], pm, pm, 0.99, 0.9, whiten=False, rollout_ids=ids,
                                    segment_index=pos)
    want_adv, want_ret = crf.segment_gae(**b, gamma=0.99, lam=0.9, lam_critic=None)
    torch.testing.assert_close(adv[rows, cols], want_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret[rows, cols], want_ret, rtol=1e-6, atol=1e-6)


def test_policy_and_value_loss_equal_trl():
    rewards, values, pm, pm1, g = _trl_batch(seed=1)
    logp = torch.randn(values.shape, generator=g) - 1.0
    new = (logp + 0.3 * torch.randn(values.shape, generator=g)).requires_grad_()
    adv = torch.randn(values.shape, generator=g)
    loss, clipfrac = T.policy_loss(new, logp, adv, pm, 0.2)
    (gn,) = torch.autograd.grad(loss, new)
    want, want_clip = peers.trl_policy_loss(new, logp, adv, pm, 0.2)
    (wg,) = torch.autograd.grad(want, new)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gn.double(), wg.double(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(clipfrac.double(), want_clip)

    vpred = (values + 0.4 * torch.randn(values.shape, generator=g)).requires_grad_()
    returns = values + torch.randn(values.shape, generator=g)
    vf, vf_clip = T.value_loss(vpred, values, returns, pm1, 0.2)
    (gv,) = torch.autograd.grad(vf, vpred)
    want, want_clip = peers.trl_value_loss(vpred, values, returns, pm1, 0.2)
    (wg,) = torch.autograd.grad(want, vpred)
    torch.testing.assert_close(vf.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gv.double(), wg.double(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(vf_clip.double(), want_clip)


def test_whitening_needs_two_tokens():
    pm = torch.ones(2, 4, dtype=torch.bool)
    pm[0, 0] = False
    with pytest.raises(ValueError, match="at least 2"):
        T.compute_advantages(torch.zeros(2, 4), torch.zeros(2, 4), pm, pm, 1.0, 0.95)


def test_restated_whitening_equals_real_trl():
    ppo = pytest.importorskip("trl.experimental.ppo.ppo_trainer", reason=REASON)
    _, values, pm, _, _ = _trl_batch(seed=2)
    real = ppo.masked_whiten(values.double(), ~pm)
    torch.testing.assert_close(torch.where(pm, 0.0, real), torch.where(pm, 0.0, peers.whiten(values.double(), ~pm)))


def test_scalar_arguments_are_checked_by_name():
    B, L = 2, 5
    x = torch.randn(B, L)
    pad = torch.zeros(B, L, dtype=torch.bool)
    with pytest.raises(TypeError, match="cliprange_value must be a number, got NoneType"):
        T.value_loss(x, x, x, pad, None)
    with pytest.raises(TypeError, match="cliprange must be a number, got str"):
        T.policy_loss(x, x, x, pad, "0.2")
    with pytest.raises(TypeError, match="gamma must be a number"):
        T.compute_advantages(x, x, pad, pad, "abc", 0.95)
    with pytest.raises(TypeError, match="lam must be a number"):
        T.compute_advantages(x, x, pad, pad, 1.0, None)
