"""torchrl as a GAE oracle: on one-segment rows with every token trainable, `segment_gae` equals torchrl's
`vec_generalized_advantage_estimate` (each row a trajectory that terminates at its last token). Runs where
torchrl imports (`make test-integrations` installs it into build/peers); elsewhere it skips."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available

BACKENDS = [b for b in ("cpp", "triton") if b in available(torch.device("cpu"))] + ["torch"]


@pytest.fixture(scope="module")
def vec_gae():
    functional = pytest.importorskip("torchrl.objectives.value.functional",
                                     reason="torchrl is not importable (`make test-integrations` installs it)")
    return functional.vec_generalized_advantage_estimate


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 1.0)])
def test_segment_gae_equals_torchrl(vec_gae, backend, gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, L = 5, 300
    r = torch.randn(B, L, generator=g, dtype=torch.float64)
    v = torch.randn(B, L, generator=g, dtype=torch.float64)
    done = torch.zeros(B, L, 1, dtype=torch.bool)
    done[:, -1] = True
    nxt = torch.cat([v[:, 1:], torch.full((B, 1), 123.0, dtype=torch.float64)], dim=1)  # ignored where terminated
    want_adv, want_ret = vec_gae(gamma, lam, v[..., None], nxt[..., None], r[..., None], done, done)
    cu = torch.arange(0, B * L + 1, L)
    mask = torch.ones(B * L, dtype=torch.bool)
    adv, ret = crf.segment_gae(r.reshape(-1).float(), v.reshape(-1).float(), mask, cu, torch.arange(B + 1),
                               gamma=gamma, lam=lam, lam_critic=lam, backend=backend)
    torch.testing.assert_close(adv.view(B, L).double(), want_adv[..., 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret.view(B, L).double(), want_ret[..., 0], rtol=1e-4, atol=1e-4)
