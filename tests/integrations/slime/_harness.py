"""Shared pieces of the slime tests: random compacted rollouts as slime Samples (made by our
samples_from_rollout), slime's real data path (RolloutManager._convert_samples_to_train_data,
_split_train_data_by_dp, process_rollout_data), megatron-core's real parallel state over gloo, and the
expected numbers from the Rollout records themselves (crf.pack -> crf.segment_gae, and the float64 reference).

Imported only when slime and megatron-core are importable (conftest.py skips otherwise)."""
from __future__ import annotations

import argparse
import os
import random

import torch

from . import _stubs

_stubs.install()

import ray  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

import compactionrl_fast as crf  # noqa: E402
from compactionrl_fast.integrations.slime import samples_from_rollout  # noqa: E402
from compactionrl_fast.reference import gae as ref  # noqa: E402
from compactionrl_fast.rollout.records import EXEC, SUMMARY, Rollout, Segment  # noqa: E402

ADV_FN = "compactionrl_fast.integrations.slime.compute_advantages"


def prompt_heavy_rollout():
    """One exec segment of 9 tokens, 2 of them the response: at cp = 2 the zigzag chunks are 3 tokens and the
    fourth is padding, so CP rank 0 holds no response token (where slime's own ppo estimator raises IndexError)."""
    return Rollout(segments=[Segment(EXEC, list(range(1, 10)), [False] * 7 + [True] * 2, [0.0] * 7 + [-0.5] * 2)],
                   reward=1.5, finish_reason="done")


def random_rollouts(n, seed, *, long_segment=0, allow_empty=False):
    """n Rollouts of 1-4 segments (exec windows with observation runs, summaries, a final summary sometimes,
    single-token responses); `long_segment` tokens in one window; empty (untrainable) segments if allowed."""
    rng = random.Random(seed)
    out = []
    for r in range(n):
        segs = []
        n_seg = rng.randint(1, 4)
        for k in range(n_seg):
            kind = SUMMARY if (k % 2 == 1 or (k == n_seg - 1 and n_seg > 1 and rng.random() < 0.5)) else EXEC
            prompt = rng.randint(1, 6)
            mask = [False] * prompt
            if kind == SUMMARY:
                mask += [True] * rng.choice([1, 2, 5])
            elif allow_empty and rng.random() < 0.25:
                mask += [False] * rng.randint(1, 4)  # a window that holds no trainable token
            else:
                for _ in range(rng.randint(1, 3)):
                    mask += [True] * rng.choice([1, 3, 7]) + [False] * rng.randint(0, 4)
            if long_segment and r == 0 and k == 0:
                mask += [True] * long_segment
            ids = [rng.randrange(1, 1000) for _ in mask]
            lps = [-rng.random() if m else 0.0 for m in mask]
            segs.append(Segment(kind, ids, mask, lps))
        out.append(Rollout(segments=segs, reward=round(rng.gauss(0, 1), 3), finish_reason="done",
                           compactions=sum(s.kind == SUMMARY for s in segs)))
    return out


def samples_of(rollouts, shuffle_seed=None):
    """Our samples_from_rollout for each rollout (rollout id = its index); optionally shuffled, so that list
    order says nothing about segment order."""
    samples = []
    for i, ro in enumerate(rollouts):
        samples += samples_from_rollout(ro, Sample(index=i, prompt=f"task {i}"))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(samples)
    return samples


def slime_args(**kw):
    a = argparse.Namespace(
        advantage_estimator="ppo", rewards_normalization=False, reward_key=None, global_batch_size=None,
        micro_batch_size=1, use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False,
        balance_by_flops=False, rollout_data_transport="object-store", kl_coef=0.0, kl_loss_type="k1",
        use_rollout_logprobs=False, custom_advantage_function_path=ADV_FN, use_opd=False,
        normalize_advantages=False, gamma=1.0, lambd=1.0, partial_rollout=False)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def train_data(samples, args, dp_size, cp_size=1):
    """slime's real RolloutManager (a bare instance of the Ray actor's class): its batches per DP rank."""
    from slime.ray.rollout import RolloutManager

    rm = RolloutManager.__ray_actor_class__.__new__(RolloutManager.__ray_actor_class__)
    rm.args = args
    rm.custom_reward_post_process_func = None
    rm.custom_convert_samples_to_train_data_func = None
    rm.train_parallel_config = {"dp_size": dp_size, "cp_size": cp_size, "vpp_size": 1,
                                "microbatch_group_size_per_vp_stage": 1}
    if args.global_batch_size is None:
        args.global_batch_size = len({s.rollout_id for s in samples})
    data = rm._convert_samples_to_train_data(samples)
    put = ray.put
    ray.put = lambda x, **_: x  # as slime's tests do: the object store is the identity here
    try:
        return rm._split_train_data_by_dp(data)
    finally:
        ray.put = put


def rank_data(refs, args, dp_rank, dp_size):
    from slime.utils.data import process_rollout_data

    get = ray.get
    ray.get = lambda x: x
    try:
        return process_rollout_data(args, refs, dp_rank, dp_size)
    finally:
        ray.get = get


def token_inputs(samples, seed):
    """Per sample (by its global position): critic values, log-probs and reference log-probs [response]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        n = s.response_length
        out.append((torch.randn(n, generator=g), -torch.rand(n, generator=g), -torch.rand(n, generator=g)))
    return out


def add_token_inputs(rd, inputs, cp_size=1):
    """values, log_probs, ref_log_probs of this rank's samples (the CP rank's slices under CP), as the
    trainer's forward passes would have put them."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    for key, j in (("values", 0), ("log_probs", 1), ("ref_log_probs", 2)):
        rd[key] = [slice_log_prob_with_cp(inputs[p][j], t, n) if cp_size > 1 else inputs[p][j].clone()
                   for p, t, n in zip(rd["partition"], rd["total_lengths"], rd["response_lengths"])]
    return rd


def expected(rollouts, samples, inputs, *, kl_coef=0.0, critic_target="local", dtype="float32", **gae):
    """Per sample (global position): (advantages, returns) from the Rollout records themselves: crf.pack
    places the rewards, values and KL go to the response positions, then crf.segment_gae (dtype float32) or
    the float64 reference (dtype float64)."""
    cross = gae.get("cross_segment", "paper")
    batch = crf.pack(rollouts, reward_mode="stitched" if cross == "stitched" else "paper", mask_errors=False)
    T = batch.num_tokens
    values, kl = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    where = {}  # (rollout, segment) -> (start of the response in the packed batch, end)
    s = 0
    for r, ro in enumerate(rollouts):
        for k, seg in enumerate(ro.segments):
            a, b = int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1])
            first = next((i for i, m in enumerate(seg.loss_mask) if m), len(seg.loss_mask))
            where[(r, k)] = (a + first, b)
            s += 1
    for p, smp in enumerate(samples):
        a, b = where[(smp.rollout_id, smp.metadata["round_number"])]
        values[a:b] = inputs[p][0].double()
        kl[a:b] = (inputs[p][1] - inputs[p][2]).double()
    rewards = batch.rewards.double() - kl_coef * kl
    if dtype == "float64":
        adv, ret = ref.segment_gae(rewards, values, batch.loss_mask, batch.cu_seqlens, batch.cu_segments, **gae)
    else:
        adv, ret = crf.segment_gae(rewards.float(), values.float(), batch.loss_mask, batch.cu_seqlens,
                                   batch.cu_segments, **gae)
        adv, ret = adv.double(), ret.double()
    if critic_target == "corrected":
        ret = torch.where(batch.loss_mask, adv + values, 0.0)
    out = []
    for smp in samples:
        a, b = where[(smp.rollout_id, smp.metadata["round_number"])]
        out.append((adv[a:b], ret[a:b]))
    return out


def split_rollouts(partitions, samples):
    """The rollouts whose samples landed on more than one rank. partitions: per DP rank, its sample indices."""
    ranks_of = {}
    for r, part in enumerate(partitions):
        for p in part:
            ranks_of.setdefault(samples[p].rollout_id, set()).add(r)
    return [rid for rid, ranks in ranks_of.items() if len(ranks) > 1]


def spawn(world, cp_size, samples, inputs, args_kw, bad_values_rank=None):
    """run_rank on `world` processes (gloo); each rank's result (or {"error": message})."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_rank, args=(world, free_port(), cp_size, samples, inputs, args_kw, d, bad_values_rank),
                 nprocs=world, join=True)
        return [torch.load(f"{d}/rank{r}.pt", weights_only=False) for r in range(world)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(rank, world, port, cp_size=1, timeout_s=None):
    """torch.distributed over gloo and megatron-core's real parallel state (no TP/PP). timeout_s: how long a
    collective may wait for a peer before it raises (a rank left waiting fails the test instead of hanging it)."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            **({} if timeout_s is None else dict(timeout=datetime.timedelta(seconds=timeout_s))))
    ps.initialize_model_parallel(1, 1, context_parallel_size=cp_size)
    return ps


def run_rank(rank, world, port, cp_size, samples, inputs, args_kw, out_dir, bad_values_rank=None):
    """One process: its rank's batch through slime's compute_advantages_and_returns; results saved.
    bad_values_rank: on that rank only, the first sample's `values` gets one entry too many."""
    torch.set_num_threads(1)
    ps = init_parallel(rank, world, port, cp_size, timeout_s=None if bad_values_rank is None else 60)
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    args = slime_args(**args_kw)
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    refs = train_data(samples, args, dp_size, cp_size)
    rd = add_token_inputs(rank_data(refs, args, dp_rank, dp_size), inputs, cp_size)
    if rank == bad_values_rank:
        rd["values"][0] = torch.cat([rd["values"][0], torch.zeros(1)])
    try:
        compute_advantages_and_returns(args, rd)
        result = {"partition": rd["partition"], "advantages": rd["advantages"], "returns": rd["returns"],
                  "total_lengths": rd["total_lengths"], "response_lengths": rd["response_lengths"]}
    except ValueError as e:
        result = {"error": str(e)}

    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def spawn_cases(world, cases, cp_size=1):
    """Several batches through slime's data path on one process group of `world` ranks (gloo): cases is a list
    of (samples, inputs, args_kw). Returns, per case, each rank's result (as run_rank's) in rank order."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_cases, args=(world, free_port(), cp_size, cases, d), nprocs=world, join=True)
        per_rank = [torch.load(f"{d}/rank{r}.pt", weights_only=False) for r in range(world)]
    return [list(results) for results in zip(*per_rank)]


def run_cases(rank, world, port, cp_size, cases, out_dir):
    """spawn_cases' process: each case's batch through slime's compute_advantages_and_returns on this rank."""
    torch.set_num_threads(1)
    ps = init_parallel(rank, world, port, cp_size)
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    out = []
    for samples, inputs, args_kw in cases:
        args = slime_args(**args_kw)
        dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rd = add_token_inputs(rank_data(train_data(samples, args, dp_size, cp_size), args, dp_rank, dp_size), inputs,
                              cp_size)
        try:
            compute_advantages_and_returns(args, rd)
            out.append({k: rd[k] for k in ("partition", "advantages", "returns", "rewards", "total_lengths",
                                            "response_lengths")})
        except ValueError as e:
            out.append({"error": str(e)})
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()
