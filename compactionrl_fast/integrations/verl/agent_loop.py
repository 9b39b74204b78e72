"""verl agent loop `compaction_agent`: our compaction loop (rollout/loop.py) inside verl's V1 agent-loop
workers, one `AgentLoopOutput` per segment (docs/verl.md).

Imports verl (verl.experimental.agent_loop); the plug-in (plugin.py) registers the loop by name.
Config: the `compaction` section of verl's trainer config (`+compaction.env=...` on the command line):

    compaction.env          "package.module:factory" (or "package.module.factory"): called with
                            `compaction.env_kwargs`, returns an environment of our `Environment` protocol
                            (reset(seed) -> (system, task); step(action) -> (observation, done, reward[, info]))
    compaction.env_kwargs   dict (default {})
    compaction.seed_key     dataset field whose value is env.reset's seed (default "index"; looked up in the
                            sample, then in its extra_info); the rollout.n sessions of a prompt share it
    compaction.rollout      RolloutConfig fields (budget, compact_threshold, keep_recent_turns, ...); with
                            `seed` set, sampling is reproducible: each session samples with its own seed
                            (`session_seed`), the same whichever server or data-parallel layout runs it
"""
from __future__ import annotations

import importlib

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from ...rollout.compaction import ChatFormat
from ...rollout.config import RolloutConfig
from ...rollout.loop import arun_rollouts
from .._common import cfg_get
from .engine import ServerManagerEngine

AGENT_NAME = "compaction_agent"


def _plain(x):
    """An OmegaConf node as plain Python (dicts, lists); anything else unchanged."""
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(x, resolve=True) if OmegaConf.is_config(x) else x
    except ImportError:
        return x


def load_factory(spec, key="compaction.env"):
    """The callable named by "module:attr" or "module.attr"; ValueError naming `key` otherwise."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key} must name an environment factory ('package.module:Class'), got {spec!r}")
    mod, sep, attr = spec.partition(":")
    if not sep:
        mod, _, attr = spec.rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{key}={spec!r} cannot be loaded: {e}") from e
    if not callable(obj):
        raise ValueError(f"{key}={spec!r} is not callable")
    return obj


def loop_settings(config):
    """(env factory, env kwargs, seed key, RolloutConfig) from the trainer config's `compaction` section."""
    sec = cfg_get(config, "compaction")
    if sec is None:
        raise ValueError("the compaction_agent loop needs a `compaction` section in the trainer config "
                         "(at least +compaction.env=package.module:EnvFactory)")
    factory = load_factory(cfg_get(sec, "env"))
    env_kwargs = _plain(cfg_get(sec, "env_kwargs", None)) or {}
    if not isinstance(env_kwargs, dict):
        raise ValueError(f"compaction.env_kwargs must be a mapping, got {type(env_kwargs).__name__}")
    rollout = _plain(cfg_get(sec, "rollout", None)) or {}
    if not isinstance(rollout, dict):
        raise ValueError(f"compaction.rollout must be a mapping of RolloutConfig fields, got {type(rollout).__name__}")
    try:
        rcfg = RolloutConfig().replace(**rollout)
    except (TypeError, ValueError) as e:
        raise ValueError(f"compaction.rollout: {e}") from e
    return factory, env_kwargs, str(cfg_get(sec, "seed_key", "index")), rcfg


def _seed(kwargs, key):
    v = kwargs.get(key)
    if v is None:
        v = cfg_get(kwargs.get("extra_info") or {}, key)
    if v is None:
        raise ValueError(f"compaction.seed_key={key!r}: the sample has no field {key!r} (nor extra_info.{key})")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"compaction.seed_key={key!r}: the sample's value {v!r} is not an integer") from None


def session_seed(seed, task_seed, session_id):
    """The sampling seed of one session: a mix of `compaction.rollout.seed`, the sample's task seed and the
    session's index among the prompt's `rollout.n` (so that sessions of one prompt differ), below 2**31."""
    return ((int(seed) * 1_000_003 + int(task_seed)) * 1_009 + int(session_id)) % (1 << 31)


def segment_outputs(rollout, rollout_id, num_turns=0, metrics=None, global_steps=(None, None)):
    """One AgentLoopOutput per segment of `rollout` that has a trainable token, in order.

    prompt_ids: the segment's tokens before its first sampled token; response_ids: the rest, with
    response_mask 1 on sampled tokens (observations and chat scaffolding 0) and the sampler's log-probs.
    The last output carries the reward (verl copies it onto the others). extra_fields: segment_index,
    rollout_id, seed (the environment's reset seed), segment_kind, compactions, finish_reason,
    reward_extra_info (the environment's info), and
    what verl's own loops set: min_global_steps / max_global_steps (the first and last weight version the
    rollout was sampled with; verl's metrics and staleness control read them), turn_scores, tool_rewards.
    """
    segs = [s for s in rollout.segments if any(s.loss_mask)]
    outs = []
    for i, s in enumerate(segs):
        start = s.loss_mask.index(True)
        outs.append(AgentLoopOutput(
            prompt_ids=list(s.input_ids[:start]), response_ids=list(s.input_ids[start:]),
            response_mask=[int(m) for m in s.loss_mask[start:]], response_logprobs=list(s.logprobs[start:]),
            num_turns=num_turns, metrics=metrics or AgentLoopMetrics(),
            reward_score=float(rollout.reward) if i == len(segs) - 1 else None,
            extra_fields={"segment_index": i, "rollout_id": rollout_id, "seed": rollout.seed, "segment_kind": s.kind,
                          "compactions": rollout.compactions, "finish_reason": rollout.finish_reason,
                          "reward_extra_info": dict(rollout.info), "min_global_steps": global_steps[0],
                          "max_global_steps": global_steps[1], "turn_scores": [], "tool_rewards": []}))
    return outs


class CompactionAgentLoop(AgentLoopBase):
    """`compaction_agent`: one compacted rollout per session (verl runs `rollout.n` sessions per prompt).

    run(sampling_params, **sample) -> list[AgentLoopOutput], one per segment (see `segment_outputs`).
    Needs verl's V1 trainer (`trainer.use_v1=true`): the legacy trainer keeps one output per sample.
    """

    async def run(self, sampling_params, **kwargs):
        trainer = cfg_get(self.config, "trainer")
        if not bool(cfg_get(trainer, "use_v1", True)):
            raise ValueError("trainer.use_v1=false: the legacy trainer keeps one output per sample, and the "
                             "compaction_agent loop returns one per segment; set trainer.use_v1=true and "
                             "trainer.v1.trainer_mode=compaction_sync")
        factory, env_kwargs, seed_key, rcfg = loop_settings(self.config)
        env = factory(**env_kwargs)
        session = kwargs.get("session_id", 0)
        rollout_id = f"{kwargs.get('uid', 'sample')}_{session}"
        task_seed = _seed(kwargs, seed_key)
        if rcfg.seed is not None:
            rcfg = rcfg.replace(seed=session_seed(rcfg.seed, task_seed, session))
        engine = ServerManagerEngine(self.server_manager, sampling_params, request_id=rollout_id)
        (rollout,) = await arun_rollouts(engine, [env], self.tokenizer, rcfg, seeds=[task_seed],
                                         chat=ChatFormat(self.tokenizer))
        steps = engine.global_steps
        if steps is None:  # a server that reports no weight version: the step the sample was drawn for
            steps = (kwargs.get("global_steps"),) * 2
        return segment_outputs(rollout, rollout_id, num_turns=2 * len(rollout.turns) + 1, global_steps=steps)
