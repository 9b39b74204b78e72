"""Trainer configuration: the paper's recipe as defaults, the CPU demo's settings as an override.

Every knob is a dataclass field. A config comes from defaults, then a YAML file, then CLI flags
(`--actor-lr 1e-4` for top-level fields, `--set env.n_digits=8` for anything, nested included).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class ModelConfig:
    """A small Hugging Face causal LM built from the environment's tokenizer, or a pretrained one."""
    pretrained: Optional[str] = None  # HF name or path; None builds a fresh model of the sizes below
    arch: str = "llama"  # "llama" or "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_positions: int = 512
    tie_embeddings: bool = True
    dtype: str = "float32"  # training dtype of the weights: float32 | bfloat16


@dataclass
class SFTConfig:
    """Supervised warm start on the scripted expert's demonstrations (fresh ones every step)."""
    steps: int = 0
    rollouts_per_step: int = 16  # expert demonstrations per step (all ranks together)
    lr: float = 2e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.05  # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    expert_drop_p: float = 0.55  # the built-in expert's summaries drop the oldest digit this often


@dataclass
class TrainConfig:
    """PPO with compaction. Defaults follow the paper (arXiv 2607.05378); see `demo_config` for the demo."""
    seed: int = 0
    run_dir: str = "runs/compactionrl"
    device: str = "auto"  # auto | cpu | cuda
    threads: Union[int, str] = 0  # torch CPU threads: 0 keeps torch's default; "auto" times steps (train/threads.py)
    # batch
    rollouts_per_step: int = 128  # global batch of rollouts (all ranks together)
    group_size: int = 1  # rollouts per task; 1 = no group baseline, the critic is the baseline
    micro_batch_tokens: int = 16384  # gradient-accumulation chunk (packed tokens per forward)
    # schedule
    steps: int = 200  # actor updates
    value_pretrain_steps: int = 50  # critic-only steps before the first actor update
    critic_updates_per_step: int = 2
    ppo_epochs: int = 1  # passes of actor updates over each batch
    ppo_minibatches: int = 1  # actor optimiser steps per pass (the batch's rollouts split evenly)
    # optimisers (Adam)
    actor_lr: float = 2e-6
    critic_lr: float = 3e-6
    adam_betas: tuple = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = 1.0
    # advantages (segment_gae)
    gamma: float = 1.0
    lam: Union[float, str] = "adaptive"
    adaptive_alpha: float = 1.5
    adaptive_length: str = "rollout"
    lam_critic: Optional[float] = 1.0
    cross_segment: str = "paper"  # paper | none | stitched
    # losses (ppo_policy_loss, value_head_loss)
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None  # truncated importance weight on rollout/trainer mismatch
    value_clip: Optional[float] = None
    loss_reduction: str = "token-mean"  # token-mean | segment-mean (ablation) | rollout-mean | sum
    train_summary_tokens: bool = True  # False: the ablation with summary tokens out of the policy loss
    temperature: float = 1.0  # rollout sampling temperature; log-probs are taken at the same one
    # logging, evaluation, checkpoints
    log_every: int = 1
    gap_every: int = 10  # paper-vs-stitched advantage gap every N steps (0: never)
    eval_every: int = 0  # 0: no evaluation during training
    eval_rollouts: int = 512
    checkpoint_every: int = 50  # 0: only at the end
    progress: bool = True
    # parts
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    env: dict = field(default_factory=dict)  # keyword arguments of the environment
    rollout: dict = field(default_factory=dict)  # keyword arguments of the rollout config


def demo_config(**overrides) -> TrainConfig:
    """The CPU demo (docs/demo.md): tiny model, SFT warm start on an expert whose summaries
    drop the oldest digit 60% of the time, then 64 rollouts a step in 2 actor mini-batches, lr 3e-4/1e-3."""
    cfg = TrainConfig(
        # "auto": 2 threads are ~1.65x faster on the idle 2-core machine, 2-7x slower when it is shared
        run_dir="runs/demo", threads="auto", rollouts_per_step=64, ppo_minibatches=2, steps=60, value_pretrain_steps=10,
        actor_lr=3e-4, critic_lr=1e-3, clip_high=0.2, max_grad_norm=1.0, micro_batch_tokens=1 << 30,
        gap_every=10, checkpoint_every=0,
        sft=SFTConfig(steps=1000, rollouts_per_step=16, lr=2e-3, expert_drop_p=0.6),
    )
    return update(cfg, overrides)


# ----------------------------------------------------------------------------------------------
# help: one line per field, allowed values first (the CLI's --help, `train --help-config`, docs/config.md)

HELP = {
    # TrainConfig
    "seed": "seed of the model initialisation, the training tasks and the sampling",
    "run_dir": "folder of config.json, metrics.jsonl, checkpoint.pt, actor/ and plots/",
    "device": "auto | cpu | cuda: where the models train (auto: cuda when available)",
    "threads": "torch CPU threads: 0 keeps torch's default (usually one per core), N uses N, 'auto' times steps at 1 and "
               "at all cores every minute and keeps the faster count (the numbers do not change)",
    "rollouts_per_step": "rollouts in the global batch of a step (all ranks together; divisible by the ranks)",
    "group_size": "rollouts per task; 1: no group baseline, the critic is the baseline",
    "micro_batch_tokens": "packed tokens per forward pass (gradient accumulation); whole rollouts per chunk",
    "steps": "actor updates (PPO steps after value pre-training)",
    "value_pretrain_steps": "critic-only steps before the first actor update",
    "critic_updates_per_step": "critic optimiser steps per PPO step, all on the same returns",
    "ppo_epochs": "passes of actor updates over each batch",
    "ppo_minibatches": "actor optimiser steps per pass (the batch's rollouts split evenly)",
    "actor_lr": "Adam learning rate of the actor",
    "critic_lr": "Adam learning rate of the critic",
    "adam_betas": "Adam betas (beta1, beta2) of both optimisers",
    "adam_eps": "Adam epsilon of both optimisers",
    "weight_decay": "Adam weight decay of both optimisers",
    "max_grad_norm": "gradient-norm clip of both models; null: no clipping",
    "gamma": "discount in [0, 1] (the paper: 1)",
    "lam": "GAE lambda: a float in [0, 1], or 'adaptive' = 1 - 1/(adaptive_alpha * l), l the trainable "
           "tokens of the rollout or segment (adaptive_length)",
    "adaptive_alpha": "alpha > 0 of the adaptive lambda",
    "adaptive_length": "rollout | segment: which trainable-token count the adaptive lambda uses",
    "lam_critic": "lambda of the critic's returns (1: Monte-Carlo returns at gamma=1); null: the advantages' lambda",
    "cross_segment": "paper | none | stitched: GAE across a rollout's segments. paper: each segment's GAE "
                     "scaled by (gamma*lam)^N, N = trainable tokens in later segments; none: unscaled "
                     "(ablation); stitched: one exact GAE over the rollout's segments",
    "clip_low": "PPO ratio clip below: ratios under 1 - clip_low are clipped",
    "clip_high": "PPO ratio clip above: ratios over 1 + clip_high are clipped (the paper: 0.28)",
    "dual_clip": "dual-clip constant c > 1 for negative advantages; null: off",
    "tis_cap": "cap of the truncated importance weight on the sampler/trainer log-prob mismatch; null: off",
    "value_clip": "value-loss clip eps (PPO-style, around the old values); null: unclipped",
    "loss_reduction": "token-mean | segment-mean | rollout-mean | sum: how the policy loss averages tokens. "
                      "token-mean: over all trainable tokens of the global batch (the paper); segment-mean: "
                      "mean of per-segment means (ablation: w/o token-level loss)",
    "train_summary_tokens": "true | false: false takes summary tokens out of the policy loss (ablation)",
    "temperature": "rollout sampling temperature > 0; the trainer's log-probs use the same one",
    "log_every": "write a metrics row every N steps",
    "gap_every": "every N steps log the gap between the paper's and the stitched advantages (0: never)",
    "eval_every": "evaluate every N actor updates (0: no evaluation during training)",
    "eval_rollouts": "held-out tasks per evaluation",
    "checkpoint_every": "write checkpoint.pt every N steps (0: only at the end)",
    "progress": "true | false: progress bars",
    "env": "keyword arguments of the built-in memory task (see env.*)",
    "rollout": "keyword arguments of the rollout config over memory_config() (see rollout.*)",
    # ModelConfig
    "model.pretrained": "Hugging Face name or path of a pretrained causal LM; null: a fresh model of the sizes below",
    "model.arch": "llama | qwen2: architecture of a fresh model",
    "model.hidden_size": "hidden size of a fresh model",
    "model.num_layers": "transformer layers of a fresh model",
    "model.num_heads": "attention heads of a fresh model",
    "model.intermediate_size": "MLP width of a fresh model",
    "model.max_positions": "maximum positions of a fresh model (>= the rollout budget)",
    "model.tie_embeddings": "true | false: tie input embeddings and LM head",
    "model.dtype": "float32 | bfloat16: dtype of the weights in training",
    # SFTConfig
    "sft.steps": "SFT optimiser steps before RL (0: no SFT)",
    "sft.rollouts_per_step": "fresh expert demonstrations per step (all ranks together)",
    "sft.lr": "peak AdamW learning rate",
    "sft.warmup_steps": "linear warm-up steps",
    "sft.min_lr_ratio": "cosine decay ends at lr * min_lr_ratio",
    "sft.weight_decay": "AdamW weight decay",
    "sft.max_grad_norm": "gradient-norm clip",
    "sft.expert_drop_p": "probability that the scripted expert's summary drops the oldest digit",
}

# CLI placeholders where the default's type does not say what is allowed
METAVAR = {"device": "{auto,cpu,cuda}", "threads": "{0,N,auto}", "lam": "{FLOAT,adaptive}",
           "adaptive_length": "{rollout,segment}", "lam_critic": "{FLOAT,null}", "cross_segment": "{paper,none,stitched}",
           "dual_clip": "{FLOAT,null}", "tis_cap": "{FLOAT,null}", "value_clip": "{FLOAT,null}",
           "max_grad_norm": "{FLOAT,null}", "loss_reduction": "{token-mean,segment-mean,rollout-mean,sum}",
           "train_summary_tokens": "{true,false}", "progress": "{true,false}"}

# keys of the dict sections: the memory task's constructor and the rollout config (documented there)
ENV_HELP = {
    "env.n_digits": "digits to remember, 1..9",
    "env.n_fillers": "filler words per observation (longer observations compact sooner)",
    "env.n_blank": "extra turns without a digit, at random places",
}
ROLLOUT_HELP = {
    "rollout.budget": "working-context budget C in tokens",
    "rollout.compact_threshold": "T_comp: compact after a turn when budget - context < T_comp",
    "rollout.keep_recent_turns": "k: last turns kept after a compaction (lowered until the context fits)",
    "rollout.max_compactions": "summaries per rollout at most; then a full context truncates the rollout",
    "rollout.max_response_tokens": "cap of one response",
    "rollout.max_turns": "turns per rollout at most (then truncated)",
    "rollout.summary_max_tokens": "cap of one summary (null: max_response_tokens)",
    "rollout.summary_instruction": "the instruction that asks for a summary",
    "rollout.resume_template": "the rebuilt context's user message; holds {task} and {summary}",
    "rollout.truncation_marker": "text appended to an observation cut to fit the budget",
    "rollout.top_p": "nucleus sampling threshold in (0, 1]",
    "rollout.truncated_reward": "final reward of a truncated rollout (null: the environment's reward so far)",
    "rollout.error_reward": "final reward of a rollout whose environment raised",
    "rollout.stop_token_ids": "extra stop token ids",
}


# ----------------------------------------------------------------------------------------------
# loading


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _coerce(value, default):
    """Parse a CLI/YAML value to the type of the field's default where it is clear."""
    if isinstance(value, str):
        import yaml

        value = yaml.safe_load(value) if value != "" else value
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def update(cfg, values: dict):
    """Return a copy of dataclass `cfg` with `values` applied; keys may be dotted ("sft.lr")."""
    out = dataclasses.replace(cfg)
    for key, value in values.items():
        head, _, rest = key.replace("-", "_").partition(".")
        names = {f.name for f in dataclasses.fields(out)}
        if head not in names:
            raise ValueError(f"unknown config key {key!r}; known: {sorted(names)}")
        cur = getattr(out, head)
        if dataclasses.is_dataclass(cur):
            sub = value if not rest else {rest: value}
            if not isinstance(sub, dict):
                raise ValueError(f"config key {key!r} is a section; give a mapping or a dotted key")
            setattr(out, head, update(cur, sub))
        elif isinstance(cur, dict):
            new = dict(cur)
            if rest:
                new[rest] = _coerce(value, new.get(rest))
            else:
                new.update(value)
            setattr(out, head, new)
        else:
            if rest:
                raise ValueError(f"config key {key!r}: {head} is not a section")
            setattr(out, head, _coerce(value, cur))
    return out


def load_yaml(path: str) -> dict:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must hold a mapping")
    return data


def add_arguments(parser: argparse.ArgumentParser, base: TrainConfig) -> None:
    """`--config FILE`, `--set KEY=VALUE` (repeatable) and a flag per top-level scalar field."""
    parser.add_argument("--config", help="YAML file with config fields (applied before the flags)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any field, dotted for sections: --set sft.steps=500 --set env.n_digits=8 "
                             "(all keys: --help-config or docs/config.md); VALUE is read as YAML")
    for f in dataclasses.fields(base):
        default = getattr(base, f.name)
        if dataclasses.is_dataclass(default) or isinstance(default, (dict, tuple)):
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), dest="cfg_" + f.name, default=None,
                            metavar=METAVAR.get(f.name, type(default).__name__.upper() if default is not None
                                                else "VALUE"),
                            help=f"{HELP.get(f.name, '')} (default: {default})".lstrip())


def from_args(args: argparse.Namespace, base: TrainConfig) -> TrainConfig:
    """Defaults < YAML file < flags < --set."""
    cfg = base
    if getattr(args, "config", None):
        cfg = update(cfg, load_yaml(args.config))
    flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    cfg = update(cfg, flags)
    sets = {}
    for item in getattr(args, "set", None) or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        sets[key.strip()] = value
    return update(cfg, sets)


def dumps(cfg) -> str:
    return json.dumps(to_dict(cfg), indent=1, default=str)


def from_dict(data: dict, base: Any = None) -> TrainConfig:
    return update(base if base is not None else TrainConfig(), data)
