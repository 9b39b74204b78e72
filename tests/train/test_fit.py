"""The training loop `fit` in-process on the tiny task: the seeds each iteration samples with, value
pre-training leaving the actor alone, the metrics rows and their cadence, evaluation, progress and
checkpoint cadence; and `evaluate`."""
import copy
import json
import os
import time

import pytest
import torch

from compactionrl_fast.app import runner
from compactionrl_fast.rollout import loop
from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine
from compactionrl_fast.rollout.metrics import GAE_KEYS, rollout_facts
from compactionrl_fast.rollout.metrics import compaction_metrics as vocabulary
from compactionrl_fast.train import dist, log as train_log, loop as train_loop, trainer
from compactionrl_fast.train.log import MetricsLog, rollout_metrics
from compactionrl_fast.train.loop import EVAL_SEED_BASE, evaluate, fit
from compactionrl_fast.train.model import critic_from_actor
from compactionrl_fast.train.trainer import make_state

from ._tiny import tiny_train_config


class _Progress:
    def __init__(self):
        self.updates, self.postfix = [], []

    def update(self, n):
        self.updates.append(n)

    def set_postfix(self, **kw):
        self.postfix.append(kw)


class _Tuner:
    """A thread tuner that reports a fixed thread count (fit logs it)."""

    def __init__(self):
        self.steps = 0

    def step(self):
        import contextlib

        self.steps += 1
        return contextlib.nullcontext(3)


def _run_fit(tmp):
    """fit over 1 value pre-training + 3 PPO iterations, log_every=2, eval_every=3, checkpoint_every=2, gap_every=2,
    2 mini-batches, recording every run_rollouts and train_step call, the actor after each iteration and the
    checkpoints."""
    cfg = tiny_train_config(tmp / "run", steps=3, log_every=2, eval_every=3, checkpoint_every=2, gap_every=2, seed=7,
                            group_size=2, temperature=0.9, rollouts_per_step=2, ppo_minibatches=2)
    tok, make_envs, rcfg = runner.task(cfg)
    actor = runner.build(cfg, tok)
    state = make_state(cfg, actor, critic_from_actor(actor))
    engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    rec = dict(calls=[], actor=[copy.deepcopy(actor.state_dict())], rollouts=[], evals=[], saves=[], steps=[])
    real_run, real_save, real_step = loop.run_rollouts, trainer.save_state, trainer.train_step

    def train_step(state, batches, **kw):
        rec["steps"].append((len(batches), kw))
        return real_step(state, batches, **kw)

    def run_rollouts(engine, envs, tokenizer, c, seeds, chat=None):
        rec["calls"].append((list(seeds), c.seed, c.temperature, len(envs)))
        return real_run(engine, envs, tokenizer, c, seeds, chat=chat)

    def metrics_fn(rollouts):
        rec["actor"].append(copy.deepcopy(actor.state_dict()))
        rec["rollouts"].append(rollouts)
        return {"task/n": len(rollouts)}

    def eval_fn(s):
        rec["evals"].append(s.step)
        return {"eval/step": s.step}

    def save_state(s, run_dir):
        rec["saves"].append(s.step)
        return real_save(s, run_dir)

    progress, tuner = _Progress(), _Tuner()
    mp = pytest.MonkeyPatch()
    mp.setattr(loop, "run_rollouts", run_rollouts)
    mp.setattr(trainer, "save_state", save_state)
    mp.setattr(trainer, "train_step", train_step)
    t0 = time.perf_counter()
    try:
        out = fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=runner.packer(cfg),
                  run_dir=cfg.run_dir, progress=progress, eval_fn=eval_fn, metrics_fn=metrics_fn, tuner=tuner)
    finally:
        mp.undo()
    elapsed = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    return dict(cfg=cfg, state=state, out=out, rec=rec, rows=rows, progress=progress, tuner=tuner, elapsed=elapsed)


def test_fit_in_process(tmp_path):
    """One fit run checked from every side (one test: mutation testing maps the run to the test that made it)."""
    run = _run_fit(tmp_path)
    _check_seeds(run)
    _check_pretraining(run)
    _check_rows(run)
    _check_progress_and_checkpoints(run)


def _check_seeds(run):
    cfg, rec = run["cfg"], run["rec"]
    assert run["out"] is run["state"] and run["state"].step == 4
    assert len(rec["calls"]) == 4
    for it, (seeds, seed, temperature, n_envs) in enumerate(rec["calls"]):
        base = (7 * 100_003 + it) * 2
        assert seeds == [base // 2] * 2  # group_size 2: the pair shares a task
        assert seed == (7 * 100_003 + it) * 1009
        assert temperature == 0.9 and n_envs == 2
    assert rec["calls"][0][0] == train_loop.train_seeds(cfg, 0, 0, 2)
    assert train_loop.train_seeds(cfg, 3, 1, 3) == [((7 * 100_003 + 3) * 2 + 3 + i) // 2 for i in range(3)]


def _check_pretraining(run):
    a = run["rec"]["actor"]
    assert len(a) == 5

    def moved(x, y):
        return any(not torch.equal(x[k], y[k]) for k in x)

    assert not moved(a[0], a[1])  # iteration 0: value pre-training
    assert all(moved(a[i], a[i + 1]) for i in (1, 2, 3))


def _check_rows(run):
    rows, rec = run["rows"], run["rec"]
    # log_every=2: iterations 0 and 2, and the last one
    assert [r["step"] for r in rows] == [0, 2, 3]
    assert [r["phase"] for r in rows] == ["value_pretrain", "ppo", "ppo"]
    assert [r["actor_step"] for r in rows] == [0, 2, 3]
    assert all(r["threads"] == 3 for r in rows) and run["tuner"].steps == 4
    for r, ro in zip(rows, [rec["rollouts"][i] for i in (0, 2, 3)]):
        assert r["task/n"] == 2
        # durations of parts of the run: positive, together at most the whole run
        assert r["time/rollout_s"] > 0 and r["time/train_s"] > 0
        assert r["time/rollout_s"] + r["time/train_s"] <= run["elapsed"]
        for k, v in rollout_metrics(ro).items():
            assert r[k] == pytest.approx(v)
        # and the recipe's vocabulary (docs/metrics.md) of the step's rollouts, the scale from the config's GAE
        want = train_log.compaction_metrics(ro, run["cfg"])
        assert "compaction/cross_segment_scale/min" in want and "compaction/rollouts" in want
        assert {k: v for k, v in r.items() if k.startswith("compaction/")} == pytest.approx(want)
    # the actor's metrics only in PPO iterations; the gap (gap_every=2) at iterations 0 and 2 only
    assert "actor/policy_loss" not in rows[0] and "actor/policy_loss" in rows[1] and "actor/grad_norm" in rows[2]
    assert "gap_abs_mean" in rows[0] and "gap_abs_mean" in rows[1] and "gap_abs_mean" not in rows[2]
    # eval_every=3 counts actor steps: after actor step 3 (iteration 3, state.step 4), not in pre-training
    assert rec["evals"] == [4]
    assert rows[2]["eval/step"] == 4 and "eval/step" not in rows[0] and "eval/step" not in rows[1]
    # train_step: one micro-batch per mini-batch (2 rollouts, 2 mini-batches), the actor from iteration 1,
    # the gap at iterations 0 and 2
    assert [n for n, _ in rec["steps"]] == [2] * 4
    assert [kw["minibatches"] for _, kw in rec["steps"]] == [[[0], [1]]] * 4
    assert [kw["update_actor"] for _, kw in rec["steps"]] == [False, True, True, True]
    assert [kw["advantage_gap"] for _, kw in rec["steps"]] == [True, False, True, False]


def _check_progress_and_checkpoints(run):
    p = run["progress"]
    assert p.updates == [1, 1, 1, 1]
    assert [x["ph"] for x in p.postfix] == ["V", "PPO", "PPO", "PPO"]
    for x, ro in zip(p.postfix, run["rec"]["rollouts"]):
        m = rollout_metrics(ro)
        assert x["succ"] == f"{m['success']:.2f}" and x["R"] == f"{m['reward']:.2f}"
    assert run["rec"]["saves"] == [2, 4]


def test_fit_refuses_a_batch_the_world_does_not_divide(tmp_path, monkeypatch):
    cfg = tiny_train_config(tmp_path, rollouts_per_step=3)
    monkeypatch.setattr(dist, "world", lambda: (0, 2))
    with pytest.raises(ValueError, match="rollouts_per_step"):
        fit(make_state(cfg, *_models(cfg)), engine=None, make_envs=None, tokenizer=None, rollout_cfg=None, pack=None,
            run_dir=str(tmp_path))


def _models(cfg):
    tok, _, _ = runner.task(cfg)
    actor = runner.build(cfg, tok)
    return actor, critic_from_actor(actor)


def test_metrics_log_resume_keeps_rows_before_the_step(tmp_path):
    log = MetricsLog(str(tmp_path), tensorboard=False)
    for s in range(4):
        log.log(s, {"x": float(s), "bad": float("nan")})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[2]["x"] == 2.0
    MetricsLog(str(tmp_path), resume_step=2, tensorboard=False)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1]
    MetricsLog(str(tmp_path), tensorboard=False)  # a fresh run starts a fresh file
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_evaluate_runs_held_out_seeds_greedy(tmp_path, monkeypatch):
    cfg = tiny_train_config(tmp_path)
    tok, make_envs, rcfg = runner.task(cfg)
    actor = runner.build(cfg, tok)
    engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    calls = []
    real = loop.run_rollouts

    def run_rollouts(engine, envs, tokenizer, c, seeds, chat=None):
        calls.append((list(seeds), c.seed, c.temperature, len(envs)))
        return real(engine, envs, tokenizer, c, seeds, chat=chat)

    monkeypatch.setattr(loop, "run_rollouts", run_rollouts)
    m, ro = evaluate(engine, make_envs, tok, rcfg, 5, temperature=0.0, seed_base=50, chunk=2)
    assert calls == [([50, 51], 50, 0.0, 2), ([52, 53], 50, 0.0, 2), ([54], 50, 0.0, 1)]
    assert len(ro) == 5 and m == rollout_metrics(ro)
    calls.clear()
    evaluate(engine, make_envs, tok, rcfg, 1, temperature=0.5)
    assert calls == [([EVAL_SEED_BASE], EVAL_SEED_BASE, 0.5, 1)]


def test_metrics_log_resume_keeps_rows_without_a_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"note": "header"}\n{"step": 0}\n{"step": 1}\n')
    MetricsLog(str(tmp_path), resume_step=1, tensorboard=False)
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [{"note": "header"}, {"step": 0}]


def test_metrics_log_writes_tensorboard_under_the_run(tmp_path, monkeypatch):
    """With tensorboard importable (faked here: it is not installed), scalars go to run_dir/tb by default."""
    import sys
    import types

    writers = []

    class SummaryWriter:
        def __init__(self, logdir):
            self.logdir, self.calls = logdir, []
            writers.append(self)

        def add_scalar(self, k, v, step):
            self.calls.append((k, v, step))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    log = MetricsLog(str(tmp_path))
    assert log.tb is writers[0] and writers[0].logdir == os.path.join(str(tmp_path), "tb")
    log.log(3, {"a": 1.0})
    assert writers[0].calls == [("a", 1.0, 3)]
    assert MetricsLog(str(tmp_path), tensorboard=False).tb is None and len(writers) == 1


def test_metrics_log_writes_nothing_on_other_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "world", lambda: (1, 2))
    log = MetricsLog(str(tmp_path / "r"))
    log.log(0, {"a": 1.0})
    assert log.tb is None and not os.path.exists(tmp_path / "r")


@pytest.mark.parametrize("err", [28, 5])  # ENOSPC, EIO
def test_metrics_log_leaves_no_partial_line_when_a_write_fails(tmp_path, monkeypatch, err):
    import builtins
    import errno

    log = MetricsLog(str(tmp_path), tensorboard=False)
    log.log(0, {"a": 1.0})
    before = (tmp_path / "metrics.jsonl").read_text()

    class HalfWrite:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, s):
            self.f.write(s[: len(s) // 2])
            self.f.flush()
            raise OSError(err, os.strerror(err))

    monkeypatch.setattr(train_log, "open", lambda *a, **k: HalfWrite(builtins.open(*a, **k)), raising=False)
    with pytest.raises(OSError) as e:
        log.log(1, {"a": 2.0})
    assert e.value.errno == err
    assert ("no space left" in str(e.value)) == (err == errno.ENOSPC)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_fit_on_rank_1_of_2_averages_rollout_metrics(tmp_path, monkeypatch):
    """A faked two-rank world (see test_trainer._FakeWorld: the other rank's sums are this rank's plus 1):
    rank 1 samples its own seeds, its fixed rollout metrics are averaged over the ranks, the environments'
    keys stay its own, and every all-reduce carries the state's group."""
    from .test_trainer import _FakeWorld

    # the faked other rank's gap is this one's + 1 (see _FakeWorld): the guard is tested elsewhere
    cfg = tiny_train_config(tmp_path / "run", steps=1, value_pretrain_steps=1, rollouts_per_step=2, seed=3,
                            sampler_logp_tol=None)
    tok, make_envs, rcfg = runner.task(cfg)
    actor = runner.build(cfg, tok)
    state = make_state(cfg, actor, critic_from_actor(actor), group="g")
    engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    calls, rollouts, rows = [], [], []
    real_run = loop.run_rollouts

    def run_rollouts(engine, envs, tokenizer, c, seeds, chat=None):
        calls.append((list(seeds), c.seed, len(envs), chat))
        return real_run(engine, envs, tokenizer, c, seeds)

    class Log:
        def log(self, step, metrics):
            rows.append((step, dict(metrics)))

    monkeypatch.setattr(loop, "run_rollouts", run_rollouts)
    w = _FakeWorld(monkeypatch, rank=1)
    gathered = []

    def all_gather_object(out, obj, group=None):  # the other rank (0) saw the same segments, all "done"
        gathered.append((len(out), group))
        out[:] = [[f._replace(rollout=(0, f.rollout[1]), finish_reason="done") for f in obj], obj]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=runner.packer(cfg),
        run_dir=cfg.run_dir, log=Log(), metrics_fn=lambda r: rollouts.append(r) or {}, chat="chat")
    assert [c[0] for c in calls] == [train_loop.train_seeds(cfg, it, 1, 1) for it in range(2)]
    assert [c[1:] for c in calls] == [((3 * 100_003 + it) * 1009 + 1, 1, "chat") for it in range(2)]
    assert [r[0] for r in rows] == [0, 1]
    for (_, m), ro in zip(rows, rollouts):
        for k, v in rollout_metrics(ro).items():
            assert m[k] == pytest.approx(v if k.startswith("info/") else (2 * v + 1) / 2)
        # the recipe's vocabulary: of both ranks' segments (gathered, not averaged)
        mine = rollout_facts(ro, ids=[(1, 0)])
        facts = [f._replace(rollout=(0, 0), finish_reason="done") for f in mine] + mine
        gae = {k: getattr(cfg, k) for k in GAE_KEYS}
        assert {k: v for k, v in m.items() if k.startswith("compaction/")} == pytest.approx(vocabulary(facts, gae))
        assert m["compaction/rollouts"] == 2
    assert gathered == [(2, "g")] * 2
    assert w.calls and all(c[3] == "g" for c in w.calls)
