"""Host syncs of one `train_step`: at most 3, all in the step's one read of its metrics at the end.

The step runs on fake tensors (FakeTensorMode: shapes and devices, no data) with the tiny model, the
default config (2 critic updates, adaptive lambda, the paper's cross-segment mode, diagnostics) and 3
micro-batches of packed expert rollouts whose layouts (`micro_batch.MicroBatch`) were derived on the host,
as `loop.micro_batches` derives them. Every host read of device data is counted (tests/train/_host_reads.py).
Fake tensors are "cuda" where this torch is built with CUDA; a CPU-only torch refuses fake CUDA tensors
at its Python methods' device guards, so there the device data are fake CPU tensors, counted from the
micro-batches and the models onward (what is computed from them counts; host data such as Adam's step
counters does not), and the ops' own CPU branches are left out: they read on the CPU where that is no sync
(`value_head`'s finite check of its weight gradient), and tests/ops checks on fake CUDA that the ops never
read the device. Not seen here: Hugging Face's SDPA mask check (`_ignore_causal_mask_sdpa` reads the padding
mask: up to 2 reads per decoder call on the padded path) skips itself on fake tensors; on CUDA the packed
flash-attention path (the default where flash-attn is installed) passes no mask.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from compactionrl_fast.ops import _dispatch
from compactionrl_fast.packing import pack
from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.micro_batch import MicroBatch
from compactionrl_fast.train.model import packed_hidden
from compactionrl_fast.train.trainer import make_state, train_step

from ._host_reads import HostReads
from ._tiny import tiny_models, tiny_rollouts

DEVICE = "cuda" if torch.backends.cuda.is_built() else "cpu"
MAX_SYNCS = 3
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not _dispatch.has_triton(),
                                reason="the ops' CUDA default backend is triton")


def _tensors(x):
    out = []
    x.map(lambda t: out.append(t) or t)
    return out


def _fake_models(fm, models):
    """The models' parameters and buffers replaced by fake tensors on DEVICE (tied weights stay tied)."""
    memo = {}
    for m in models:
        for mod in m.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    if id(p) not in memo:
                        memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=DEVICE),
                                                         requires_grad=p.requires_grad)
                    mod._parameters[name] = memo[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=DEVICE)
    return list(memo.values()) + [b for m in models for b in m.buffers()]


def _fake_step(cfg, run):
    """`run(state, micro_batches, reads)` on the fake device; returns (its result, the HostReads)."""
    rollouts = tiny_rollouts(6)
    mbs = [MicroBatch.build(pack(g, prefix_sharing=True), cfg) for g in (rollouts[:2], rollouts[2:4], rollouts[4:])]
    actor, critic = tiny_models()
    reads = HostReads(DEVICE)
    with FakeTensorMode(allow_non_fake_inputs=True) as fm:
        to_dev = (lambda t: fm.from_tensor(t).to(DEVICE)) if DEVICE == "cuda" else fm.from_tensor
        reads.on_device(_fake_models(fm, (actor, critic)))
        mbs = [mb.map(to_dev) for mb in mbs]
        for mb in mbs:
            reads.on_device(_tensors(mb))
        state = make_state(cfg, actor, critic)
        with reads:
            out = run(state, mbs, reads)
    return out, reads


@pytest.mark.parametrize("cfg,kw,keys", [
    (dict(), dict(advantage_gap=True), {"actor/policy_loss", "actor/grad_norm", "adv_exec_mean", "gap_abs_mean"}),
    # behaviour passes before the updates, 4 actor steps
    (dict(ppo_epochs=2, ppo_minibatches=2), dict(minibatches=[[0], [1, 2]], diagnose=False), {"actor/policy_loss"}),
    (dict(), dict(update_actor=False, measure_sampler_gap=True, diagnose=False), set()),  # value pre-training
])
def test_train_step_reads_the_device_at_most_3_times_all_at_the_end(cfg, kw, keys):
    out, reads = _fake_step(TrainConfig(**cfg), lambda state, mbs, _: train_step(state, mbs, **kw))
    sites = {s: n for s, n in reads.sites.items() if DEVICE == "cuda" or not s.startswith("ops/")}
    assert sum(sites.values()) <= MAX_SYNCS, f"{reads.count} host reads: {dict(reads.sites)}"
    assert all(site.startswith("train/readout.py") for site in sites), dict(reads.sites)
    assert keys | {"critic/value_loss", "sampler/logp_absdiff_max"} <= set(out)
    assert all(not isinstance(v, torch.Tensor) for v in out.values())


def test_the_count_sees_a_host_read():
    """The count above can fail: the padded forward without its host-built tables reads cu_attn."""
    def run(state, mbs, reads):
        b = mbs[0].batch
        packed_hidden(state.actor, b.input_ids, b.position_ids, b.cu_attn)
        return None

    _, reads = _fake_step(TrainConfig(), run)
    assert reads.count > 0 and any(site.startswith("train/model.py") for site in reads.sites)
