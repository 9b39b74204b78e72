"""Data parallel: a 2-process gloo step (each rank half the rollouts, in micro-batches) gives the same
gradients and weights as a 1-process step on the whole global batch, for token-mean and segment-mean
losses. Gradients are compared too: Adam's update hides a wrong gradient scale (e.g. averaging instead
of summing over ranks)."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compactionrl_fast.packing import pack
from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.trainer import make_state, train_step

from .train._tiny import tiny_models, tiny_rollouts

REDUCTIONS = ("token-mean", "segment-mean")
N = 8


def _cfg(reduction):
    return TrainConfig(actor_lr=1e-3, critic_lr=1e-3, critic_updates_per_step=2, max_grad_norm=None,
                       loss_reduction=reduction, clip_high=0.28)


def _step(reduction, groups):
    actor, critic = tiny_models(seed=3)
    state = make_state(_cfg(reduction), actor, critic)
    train_step(state, [pack(g, prefix_sharing=True) for g in groups], diagnose=False)
    grads = lambda m: {k: p.grad.clone() for k, p in m.named_parameters()}  # noqa: E731 (the last update's)
    return {"actor": copy.deepcopy(actor.state_dict()), "critic": copy.deepcopy(critic.state_dict()),
            "actor_grad": grads(actor), "critic_grad": grads(critic)}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rollouts = tiny_rollouts(N)
        mine = rollouts[rank * N // world:(rank + 1) * N // world]
        # ranks cut their halves differently: 1 + 3 rollouts on rank 0, 2 + 2 on rank 1
        cut = 1 if rank == 0 else 2
        res = {red: _step(red, [mine[:cut], mine[cut:]]) for red in REDUCTIONS}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()  # tear gloo down together (tests/test_distributed.py: a rank leaving early can abort)
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_process_step_equals_one_process_step(tmp_path):
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    torch.set_num_threads(1)
    rollouts = tiny_rollouts(N)
    for red in REDUCTIONS:
        ref = _step(red, [rollouts])
        for rank in (0, 1):
            got = torch.load(tmp_path / f"rank{rank}.pt")[red]
            for model in ("actor", "critic", "actor_grad", "critic_grad"):
                for k, v in ref[model].items():
                    torch.testing.assert_close(got[model][k], v, atol=1e-6, rtol=1e-5,
                                               msg=lambda m: f"{red} {model}.{k} rank {rank}: {m}")
