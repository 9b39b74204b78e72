"""Checkpoint and resume: the step after a resume is bitwise the step of an uninterrupted run (CPU)."""
import shutil

import torch

from compactionrl_fast import demo
from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine
from compactionrl_fast.train import checkpoint
from compactionrl_fast.train.model import critic_from_actor
from compactionrl_fast.train.trainer import fit, load_state, make_state

from ._tiny import tiny_train_config


def _run(cfg, resume_from=None):
    tok, make_envs, rcfg = demo.task(cfg)
    actor = demo.build(cfg, tok)
    state = make_state(cfg, actor, critic_from_actor(actor))
    if resume_from is not None:
        load_state(state, resume_from)
    engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=demo.packer(cfg),
        run_dir=cfg.run_dir)
    return state


def test_resume_reproduces_the_next_step_bitwise(tmp_path):
    a = _run(tiny_train_config(tmp_path / "a", checkpoint_every=2))  # 3 iterations, checkpoint after 2
    assert a.step == 3 and checkpoint.exists(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    torch.manual_seed(12345)  # a different RNG state before the resume: the checkpoint restores it
    b = _run(tiny_train_config(tmp_path / "b", checkpoint_every=0), resume_from=str(tmp_path / "b"))
    assert b.step == 3
    for name in ("actor", "critic"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{name}.{k} differs after resume"
    oa, ob = a.opt_actor.state_dict()["state"], b.opt_actor.state_dict()["state"]
    assert all(torch.equal(oa[i]["exp_avg"], ob[i]["exp_avg"]) for i in oa)
    # the resumed run's log holds each step once
    import json

    steps = [json.loads(x)["step"] for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert steps == [0, 1, 2]
