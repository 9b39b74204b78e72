"""One run on the built-in memory task, in pieces the demo, the ablations and `train` share.

`task` (tokenizer, environments, rollout config), `build` (the actor), `run_sft` (supervised warm start on
fresh expert demonstrations), `run_rl` (critic, value pre-training, PPO with compaction), `run_eval`
(held-out success, sampled and greedy), and `train`: the entry point of `python -m compactionrl_fast train`
(single process or torchrun).
"""
from __future__ import annotations

import os

import torch

from ..train import atomic, checkpoint
from ..train.config import TrainConfig
from ..train.config_load import dumps
from ..train.engines import make_engine
from ..train.cpu_malloc import keep_freed_memory
from ..train.threads import make_tuner, maybe_step
from ..train.dist import world
from ..train.log import MetricsLog
from ..train.loop import EVAL_SEED_BASE, evaluate, fit, split_rollouts
from ..train.trainer import load_state, make_state, save_state

SFT_SEED_BASE = 2_000_000_000  # demonstrations are seeded apart from RL and evaluation tasks

_POSITION = [None]  # this process's progress-bar line when jobs run in several processes at once


def bar_position(position):
    """Put this process's progress bars on line `position` (jobs in several processes at once)."""
    _POSITION[0] = position


def _tqdm(**kw):
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, position=_POSITION[0], **kw)


def task(cfg: TrainConfig):
    """(tokenizer, make_envs, rollout config) of the built-in memory task from cfg.env / cfg.rollout.

    The task's word tokenizer, or the pretrained model's own (the task is plain words and its chat
    template formats the conversation)."""
    from ..envs.memory import MemoryEnv, memory_config, memory_tokenizer

    if cfg.model.pretrained:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.model.pretrained)
    else:
        tok = memory_tokenizer()
    rcfg = memory_config(**cfg.rollout)
    return tok, (lambda n: [MemoryEnv(**cfg.env) for _ in range(n)]), rcfg


def packer(cfg: TrainConfig):
    """pack() with prefix sharing, the final rewards placed as the trainer reads them (so it reuses them)."""
    from ..packing import pack
    from ..train.micro_batch import reward_mode

    mode = reward_mode(cfg)
    return lambda rollouts: pack(rollouts, prefix_sharing=True, reward_mode=mode)


def build(cfg: TrainConfig, tok, device="cpu"):
    """A fresh actor for the tokenizer (seeded by cfg.seed), or the pretrained one of cfg.model."""
    from ..train.model import build_actor

    torch.manual_seed(cfg.seed)
    return build_actor(cfg.model, len(tok), device=device, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id)


def run_sft(cfg: TrainConfig, actor, tok, make_envs, rcfg, *, log=None, progress=True, tuner=None):
    """Supervised warm start on fresh expert demonstrations every step."""
    from ..envs.memory import ScriptedExpert
    from ..rollout.loop import run_rollouts
    from ..train import sft

    s = cfg.sft
    rank, ws = world()
    opt = sft.make_optimizer(actor, s)
    pack = packer(cfg)
    expert = ScriptedExpert(s.expert_drop_p, seed=cfg.seed * 1009 + rank)
    device = next(actor.parameters()).device
    n = s.rollouts_per_step
    n_local = max(n // ws, 1)
    bar = _tqdm(total=s.steps, desc=f"SFT    seed {cfg.seed}", disable=not progress or rank != 0)
    m = {}
    for step in range(s.steps):
        with maybe_step(tuner) as threads:
            seeds = [SFT_SEED_BASE + (cfg.seed * 100_003 + step) * n + rank * n_local + i for i in range(n_local)]
            demos = run_rollouts(expert, make_envs(n_local), tok, rcfg, seeds)
            batches = [pack(g).to(device) for g in split_rollouts(demos, cfg.micro_batch_tokens)]
            m = sft.sft_step(actor, opt, batches, s, lr=sft.lr_at(step, s.steps, s))
        if log is not None and (step % 10 == 0 or step == s.steps - 1):
            log.log(step, {**m, "threads": threads})
        bar.update(1)
        bar.set_postfix(loss=f"{m['sft/loss']:.3f}", thr=threads)
    bar.close()
    return m


def run_rl(cfg: TrainConfig, actor, tok, make_envs, rcfg, *, progress=True, resume=False, tuner=None, engine=None):
    """Critic from the actor, value pre-training, PPO. Returns the trained State. `engine`: the rollout
    engine (default: `make_engine(cfg, actor, tok)`); `fit` syncs one that does not share the actor."""
    from ..train.model import critic_from_actor

    critic = critic_from_actor(actor)
    state = make_state(cfg, actor, critic)
    if resume and checkpoint.exists(cfg.run_dir):
        load_state(state, cfg.run_dir)
    engine = engine or make_engine(cfg, actor, tok)
    total = cfg.value_pretrain_steps + cfg.steps
    desc = ("RL-abl " if not cfg.train_summary_tokens else "RL     ") + f"seed {cfg.seed}"
    bar = _tqdm(total=total, initial=state.step, desc=desc, disable=not progress or world()[0] != 0)
    recall = (lambda ro: {"summary_recall": summary_recall(ro)}) if not cfg.model.pretrained else None
    fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=packer(cfg),
        run_dir=cfg.run_dir, log=MetricsLog(cfg.run_dir, resume_step=state.step if resume else None), progress=bar,
        metrics_fn=recall, tuner=tuner)
    bar.close()
    if world()[0] == 0:
        save_state(state, cfg.run_dir)
    return state


def run_eval(actor, tok, make_envs, rcfg, n: int, temperature: float, *, progress=True, desc="eval",
             engine=None) -> dict:
    """Success on `n` held-out tasks, sampled at `temperature` and greedy (with a progress bar), on `engine`
    (given the actor's weights first) or the embedded engine on the actor."""
    from ..rollout.engines.transformers_engine import TransformersEngine
    from ..train.sync import push_weights

    if engine is None:
        engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    push_weights(engine, actor)
    out = {}
    rank, ws = world()
    bar = _tqdm(total=2 * len(range(rank, n, ws)), desc=desc, unit="rollout", disable=not progress or rank != 0)
    for name, t in (("sampled", temperature), ("greedy", 0.0)):
        bar.set_postfix(mode=name)
        counted, finish = _counting(make_envs, bar)
        m, ro = evaluate(engine, counted, tok, rcfg, n, temperature=t, seed_base=EVAL_SEED_BASE)
        finish()
        out[name] = {"success": m["success"], "reward": m["reward"],
                     "accuracy": m.get("info/accuracy"), "compactions": m["compactions"],
                     "summary_tokens": m["summary_tokens"], "summary_recall": summary_recall(ro)}
    bar.close()
    return out


def _counting(make_envs, bar):
    """(make_envs that advances `bar`, a function that finishes it).

    `evaluate` builds each chunk's environments just before running the chunk, so a call means the
    previous chunk is done: the bar moves by the previous call's count (and by the last one at the end)."""
    pending = [0]

    def make(n):
        bar.update(pending[0])
        pending[0] = n
        return make_envs(n)

    def finish():
        bar.update(pending[0])
        pending[0] = 0

    return make, finish


def summary_recall(rollouts) -> float | None:
    """Fraction of summaries that hold every digit revealed before them (the skill RL has to learn)."""
    from ..envs.memory import summary_correct

    flags = [ok for r in rollouts for ok in summary_correct(r)]
    return sum(flags) / len(flags) if flags else None


# ----------------------------------------------------------------------------------------------
# `python -m compactionrl_fast train` (single process or torchrun)


def device_of(cfg: TrainConfig) -> str:
    """cfg.device resolved: "cuda" or "cpu" ("auto": CUDA where available)."""
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"


def _init_distributed(cfg: TrainConfig):
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = device_of(cfg) == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def train(cfg: TrainConfig, *, resume: bool = True):
    """SFT (when cfg.sft.steps > 0 and no checkpoint exists) then value pre-training and PPO."""
    tuner = make_tuner(cfg.threads)
    _init_distributed(cfg)
    rank, _ = world()
    device = device_of(cfg)
    if device == "cpu":
        keep_freed_memory()
    tok, make_envs, rcfg = task(cfg)
    actor = build(cfg, tok, device)  # same seed on every rank: identical initial weights
    if rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        atomic.remove_stale_temps(cfg.run_dir)  # left by a run killed mid-write
        atomic.write_text(os.path.join(cfg.run_dir, "config.json"), dumps(cfg))
    sft_path = os.path.join(cfg.run_dir, "sft_actor.pt")
    has_ckpt = resume and checkpoint.exists(cfg.run_dir)
    if cfg.sft.steps > 0 and not has_ckpt:
        if resume and os.path.isfile(sft_path):
            actor.load_state_dict(checkpoint.load_state_dict(sft_path))
        else:
            run_sft(cfg, actor, tok, make_envs, rcfg, log=MetricsLog(os.path.join(cfg.run_dir, "sft")),
                    progress=cfg.progress, tuner=tuner)
            if rank == 0:
                checkpoint.save_state_dict(actor.state_dict(), sft_path)
    state = run_rl(cfg, actor, tok, make_envs, rcfg, progress=cfg.progress, resume=resume, tuner=tuner)
    if rank == 0:
        from .plots import plot_run

        plot_run(cfg.run_dir)
        if os.path.isfile(os.path.join(cfg.run_dir, "sft", "metrics.jsonl")):
            plot_run(os.path.join(cfg.run_dir, "sft"))
        with atomic.atomic_dir(os.path.join(cfg.run_dir, "actor")) as tmp:
            actor.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    return state
