"""Tiny models and hand-made packed batches for the trainer tests."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from compactionrl_fast.train.config import ModelConfig
from compactionrl_fast.train.model import build_actor, critic_from_actor

VOCAB = 34  # the memory task's tokenizer


def tiny_models(seed=0, vocab=VOCAB):
    torch.manual_seed(seed)
    actor = build_actor(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                                    max_positions=128), vocab)
    return actor, critic_from_actor(actor)


def hand_batch(seed=0, rollouts=((9, 5), (12,), (7, 4, 10)), vocab=VOCAB):
    """A PackedBatch-shaped namespace: each rollout a list of segment lengths, alternating exec/summary.

    Each segment is its own attention sequence; its first 2 tokens are prompt, then trainable tokens
    alternate with observation runs. Rewards: rollout r gets (-1)^r.
    """
    g = torch.Generator().manual_seed(seed)
    ids, pos, mask, kind, cu_seq, cu_segs = [], [], [], [], [0], [0]
    for r in rollouts:
        for j, n in enumerate(r):
            ids.append(torch.randint(0, vocab, (n,), generator=g))
            pos.append(torch.arange(n))
            m = torch.zeros(n, dtype=torch.bool)
            m[2:] = torch.rand(n - 2, generator=g) < 0.7
            mask.append(m)
            kind.append(j % 2)
            cu_seq.append(cu_seq[-1] + n)
        cu_segs.append(cu_segs[-1] + len(r))
    T = cu_seq[-1]
    R = len(rollouts)
    return SimpleNamespace(
        input_ids=torch.cat(ids), position_ids=torch.cat(pos), cu_attn=torch.tensor(cu_seq),
        cu_seqlens=torch.tensor(cu_seq), cu_segments=torch.tensor(cu_segs), loss_mask=torch.cat(mask),
        rollout_logprobs=torch.zeros(T), rewards=torch.zeros(T), segment_kind=torch.tensor(kind, dtype=torch.int8),
        rollout_rewards=torch.tensor([(-1.0) ** r for r in range(R)]))


def tiny_rollouts(n, seed=0, drop_oldest_p=0.5, n_digits=3, n_fillers=4):
    """Expert rollouts of a small memory task that compacts twice (budget 64): 5 segments, ~250 tokens."""
    from compactionrl_fast.envs.memory import MemoryEnv, ScriptedExpert, memory_config, memory_tokenizer
    from compactionrl_fast.rollout.loop import run_rollouts

    cfg = memory_config(budget=64, compact_threshold=20, max_response_tokens=6, summary_max_tokens=6)
    envs = [MemoryEnv(n_digits=n_digits, n_fillers=n_fillers) for _ in range(n)]
    return run_rollouts(ScriptedExpert(drop_oldest_p, seed=seed), envs, memory_tokenizer(), cfg,
                        seeds=[seed * 1000 + i for i in range(n)])


def tiny_train_config(run_dir, **kw):
    """A TrainConfig for seconds-long loops: tiny model, 3-digit task with budget 64 (two compactions),
    truncated rollouts rewarded -1."""
    from compactionrl_fast.train.config import SFTConfig, TrainConfig

    base = dict(run_dir=str(run_dir), rollouts_per_step=4, value_pretrain_steps=1, steps=2, actor_lr=1e-3,
                critic_lr=1e-3, gap_every=1, checkpoint_every=0, progress=False, threads=0, eval_rollouts=8,
                model=ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=128),
                sft=SFTConfig(steps=2, rollouts_per_step=2, warmup_steps=1),
                env=dict(n_digits=3, n_fillers=4),
                # an untrained model's rollouts end truncated: reward -1 there gives nonzero advantages and
                # gradients, so every step moves the weights
                rollout=dict(budget=64, compact_threshold=20, max_response_tokens=6, summary_max_tokens=6,
                             truncated_reward=-1.0))
    base.update(kw)
    return TrainConfig(**base)
