"""Our models as Hugging Face folders, for the frameworks that load a model by path (verl's actor, critic and
vLLM servers; slime's engines): `export_actor`, `export_critic`, and `sft_checkpoint`, the memory task's SFT
model trained once and cached in a folder (the job tests' start: a model that sometimes answers right).
"""
from __future__ import annotations

import json
import os

import torch

STAMP = "crf_export.json"  # what made the folder: a cached SFT is reused only when it matches


def export_actor(actor, tok, folder):
    """Save `actor` (a transformers causal LM) and its tokenizer to `folder` in float32; returns `folder`."""
    os.makedirs(folder, exist_ok=True)
    actor.to(torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def export_critic(actor, tok, folder, head=None):
    """The critic's start as a transformers token-classification model (one label): `actor`'s decoder and a
    value head, zero by default as our trainer's critic starts (`train.model.Critic`), else `head` =
    (weight [H], bias [1]). verl's critic (`load_valuehead_model`) loads this folder with its head, where a
    causal-LM folder would get a randomly initialised one. Returns `folder`."""
    from transformers import AutoModelForTokenClassification

    cfg = actor.config.__class__.from_dict(actor.config.to_dict())
    cfg.num_labels = 1
    critic = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
    body = getattr(actor, actor.base_model_prefix)
    missing, unexpected = critic.base_model.load_state_dict(body.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(f"export_critic: the decoder does not fit {type(critic).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    with torch.no_grad():
        weight, bias = (torch.zeros(cfg.hidden_size), torch.zeros(1)) if head is None else head
        critic.score.weight.copy_(weight.reshape(1, -1))
        if critic.score.bias is not None:
            critic.score.bias.copy_(bias.reshape(1))
    os.makedirs(folder, exist_ok=True)
    critic.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def sft_checkpoint(folder, *, steps=400, seed=0, threads=None, progress=False, env=None):
    """The memory task's SFT model (the demo's model and SFT recipe, `steps` steps, `seed`) as a Hugging Face
    folder with the task's tokenizer; made once, then reused while its stamp (steps, seed, env, the SFT and
    model config) matches. 400 steps (about 1 min on 2 cores) give a model that answers about a third of the
    digits right (success near 0): rewards that vary, for the `accuracy` reward of `MemoryEnv`.
    Returns `folder`."""
    from .demo import demo_config
    from .runner import build, run_sft, task
    from ..train.config_load import to_dict, update

    cfg = update(demo_config(seed=seed, threads=threads or torch.get_num_threads()),
                 {"sft": {"steps": steps}, "env": dict(env or {})})
    stamp = {"steps": steps, "seed": seed, "env": dict(env or {}), "sft": to_dict(cfg.sft), "model": to_dict(cfg.model)}
    path = os.path.join(folder, STAMP)
    if os.path.exists(path):
        with open(path) as f:
            if json.load(f) == stamp:
                return folder
    tok, make_envs, rcfg = task(cfg)
    actor = build(cfg, tok)
    with _threads(cfg.threads):
        run_sft(cfg, actor, tok, make_envs, rcfg, progress=progress)
    export_actor(actor, tok, folder)
    with open(path, "w") as f:  # last: a folder without it (an interrupted run) is made again
        json.dump(stamp, f)
    return folder


class _threads:
    """torch's thread count set for a block, then restored."""

    def __init__(self, n):
        self.n = int(n)

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)
