"""Checkpoint and resume: the step after a resume is bitwise the step of an uninterrupted run (CPU), on a
run whose steps move the weights (nonzero rewards and advantages), so a load() that skipped the models,
the optimisers or the RNG streams would fail here."""
import json
import random
import shutil

import numpy as np
import torch

from compactionrl_fast.app import runner
from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine
from compactionrl_fast.train import checkpoint
from compactionrl_fast.train.model import critic_from_actor
from compactionrl_fast.train.loop import fit
from compactionrl_fast.train.trainer import load_state, make_state

from ._tiny import tiny_train_config


def _run(cfg, resume_from=None):
    tok, make_envs, rcfg = runner.task(cfg)
    actor = runner.build(cfg, tok)
    state = make_state(cfg, actor, critic_from_actor(actor))
    if resume_from is not None:
        load_state(state, resume_from)
    engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=runner.packer(cfg),
        run_dir=cfg.run_dir)
    return state


def _rng():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _tensors(state):
    """Every tensor of the state: weights and optimiser moments of actor and critic."""
    out = {}
    for name in ("actor", "critic"):
        out.update({f"{name}.{k}": v.clone() for k, v in getattr(state, name).state_dict().items()})
        for i, s in getattr(state, "opt_" + name).state_dict()["state"].items():
            out.update({f"opt_{name}.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def test_resume_reproduces_the_next_step_bitwise(tmp_path):
    # 3 iterations (value pre-training, 2 PPO steps), checkpoint after 2; the RNG streams drawn from
    # between the checkpoint and the end must continue where they were
    a = _run(tiny_train_config(tmp_path / "a", checkpoint_every=2))
    a_rng = _rng()
    assert a.step == 3 and checkpoint.exists(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    at_ckpt = checkpoint.read(str(tmp_path / "a" / checkpoint.NAME))
    assert at_ckpt["step"] == 2

    # the step after the checkpoint moved every part of the state: weights and optimiser moments
    final = _tensors(a)
    saved = {**{f"{m}.{k}": v for m in ("actor", "critic") for k, v in at_ckpt["models"][m].items()},
             **{f"opt_{m}.{i}.{k}": v for m in ("actor", "critic")
                for i, s in at_ckpt["optimizers"][m]["state"].items() for k, v in s.items()}}
    assert saved.keys() == final.keys()
    for part in ("actor.model.embed_tokens", "critic.weight", "critic.bias", "opt_actor.0.exp_avg",
                 "opt_critic.0.exp_avg"):
        keys = [k for k in final if k.startswith(part)]
        assert keys and any(not torch.equal(final[k], saved[k]) for k in keys), f"{part} did not move"
    assert any(float(final[k].abs().max()) > 0 for k in final if k.startswith("opt_actor") and "exp_avg" in k)

    torch.manual_seed(12345)  # different RNG streams before the resume: the checkpoint restores them
    random.seed(12345)
    np.random.seed(12345)
    b = _run(tiny_train_config(tmp_path / "b", checkpoint_every=0), resume_from=str(tmp_path / "b"))
    assert b.step == 3
    resumed = _tensors(b)
    assert resumed.keys() == final.keys()
    for k in final:
        assert torch.equal(final[k], resumed[k]), f"{k} differs after resume"
    b_rng = _rng()
    assert torch.equal(a_rng[0], b_rng[0]) and a_rng[1] == b_rng[1] and np.array_equal(a_rng[2], b_rng[2])
    # the resumed run's log holds each step once
    steps = [json.loads(x)["step"] for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert steps == [0, 1, 2]
