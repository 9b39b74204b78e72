"""The verl plug-in against the real verl 0.9.1 V1 path (`make test-integrations` installs it in build/peers):
the entry point found by `import verl`, the `compaction_sync` trainer's real `_compute_advantage` on batches
laid out by verl's own `AgentLoopWorkerTQ._agent_loop_postprocess`, the old adapter refusing the V1 path,
bad input. TransferQueue's three kv_batch_* calls go to an in-memory stand-in (`MemoryTQ`).
"""
import asyncio
import os
import random
import subprocess
import sys

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.reference import gae as ref

REASON = "verl's V1 path is not importable (`make test-integrations` installs verl and TransferQueue)"
v1 = pytest.importorskip("verl.trainer.ppo.v1", reason=REASON)
from compactionrl_fast.integrations.verl import plugin as verl_plugin  # noqa: E402  (after the skip: imports verl)
from compactionrl_fast.integrations.verl import (compaction_advantages, compaction_metrics,  # noqa: E402
                                                             session_rows)


class MemoryTQ:
    """TransferQueue's kv interface in memory: rows by key, fields as verl's list_of_dict_to_tensordict
    stacks them (jagged tensors for per-token fields, NonTensorStack for strings)."""

    def __init__(self):
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        self.rows, self._stack = {}, list_of_dict_to_tensordict

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        if fields is not None:
            for i, k in enumerate(keys):
                row = self.rows.setdefault(k, {})
                for f in fields.keys():
                    v = fields[f]
                    row[f] = v.unbind()[i] if isinstance(v, torch.Tensor) else v.tolist()[i]
        return v1.trainer_base.KVBatchMeta(partition_id=partition_id, keys=list(keys), tags=tags or [{} for _ in keys])

    async def async_kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        return self.kv_batch_put(keys, partition_id, fields, tags)

    def kv_batch_get(self, keys, partition_id, select_fields):
        return self._stack([{f: self.rows[k][f] for f in select_fields if f in self.rows[keys[0]]} for k in keys])


def _worker():
    """verl's AgentLoopWorkerTQ (the class under its Ray wrapper), bare: only what postprocess reads."""
    cls = v1.agent_loop_tq.AgentLoopWorkerTQ
    cls = getattr(cls, "__ray_actor_class__", None) or cls.__ray_metadata__.modified_class
    w = object.__new__(cls)
    w.reward_loop_worker_handles, w.distillation_enabled, w.processor = None, False, None
    return w


def _outputs(rng, n_out, reward):
    """AgentLoopOutputs of one compacted session: random prompts, responses with observation spans."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    outs = []
    for i in range(n_out):
        L = rng.choice([1, 2, rng.randrange(3, 40)])
        mask = [1] * L
        if L > 3:  # an observation inside, sometimes at the end
            a = rng.randrange(1, L - 1)
            for t in range(a, min(L, a + rng.randrange(1, 6))):
                mask[t] = 0
        if rng.random() < 0.15:
            mask = [0] * L  # a segment with no trainable token
        outs.append(AgentLoopOutput(prompt_ids=[5] * rng.randrange(1, 6), response_ids=[7] * L, response_mask=mask,
                                    response_logprobs=[-0.5] * L, metrics=AgentLoopMetrics(),
                                    reward_score=reward if i == n_out - 1 else None,
                                    extra_fields={"reward_extra_info": {}, "compactions": n_out // 2,
                                                  "segment_kind": "summary" if i % 2 else "exec",
                                                  "finish_reason": "done"}))
    return outs


def _verl_batch(tq, seed, n=2, prompts=3):
    """Outputs of `prompts` x `n` sessions (1-3 outputs each) through verl's own postprocess into `tq`,
    critic values and old log-probs added as verl's _compute_values / _compute_old_log_prob store them. Returns (keys in a shuffled order, rewards)."""
    rng = random.Random(seed)
    worker = _worker()
    rewards = {}
    for p in range(prompts):
        uid = f"u{seed}-{p}"
        for s in range(n):
            r = round(rng.uniform(-1, 1), 3)
            rewards[f"{uid}_{s}"] = r
            asyncio.run(worker._agent_loop_postprocess(_outputs(rng, rng.randint(1, 3), r), False, uid=uid,
                                                       session_id=s, raw_prompt=[], global_steps=1))
    g = torch.Generator().manual_seed(seed)
    for k, row in tq.rows.items():
        row["values"] = torch.randn(row["response_mask"].numel(), generator=g)
        row["old_log_probs"] = row["rollout_log_probs"] + 0.01 * torch.randn(row["values"].shape, generator=g)
    keys = list(tq.rows)
    rng.shuffle(keys)  # verl's _balance_batch reorders rows
    return keys, rewards


def _config(n=2, **sub):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(os.path.dirname(v1.__file__), "..", "..", "config", "_generated_ppo_trainer.yaml"))
    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.gamma = sub.pop("gamma", 1.0)
    cfg.actor_rollout_ref.rollout.n = n
    cfg.trainer.v1.trainer_mode = "compaction_sync"
    cfg.algorithm.compaction_gae = sub
    return cfg


@pytest.fixture
def tq(monkeypatch):
    mem = MemoryTQ()
    monkeypatch.setattr(v1.agent_loop_tq, "tq", mem)
    monkeypatch.setattr(v1.trainer_base, "tq", mem)
    return mem


def _trainer(cfg):
    t = object.__new__(v1.get_trainer_cls("compaction_sync"))
    t.config = cfg
    return t


def _expected(tq, keys, rewards, cfg_sub, gamma, kl_beta=None):
    """crf.segment_gae on the packed batch (sessions in order, trainable tokens only) and the float64
    reference; per key the [n] advantages and returns of its trainable tokens. kl_beta: verl's KL-in-reward
    term -beta * (old_log_probs - ref_log_prob) added per token."""
    ids, pos = session_rows(keys)
    sessions = sorted(set(ids), key=ids.index)
    rows = [(rid, p) for rid in sessions for p in sorted(pp for i, pp in zip(ids, pos) if i == rid)]
    masks = [tq.rows[f"{rid}_{p}"]["response_mask"].bool() for rid, p in rows]
    vals = torch.cat([tq.rows[f"{rid}_{p}"]["values"][m] for (rid, p), m in zip(rows, masks)])
    lens = torch.tensor([0] + [int(m.sum()) for m in masks])
    cu = lens.cumsum(0)
    per = torch.tensor([0] + [sum(1 for r, _ in rows if r == rid) for rid in sessions]).cumsum(0)
    loss_mask = torch.ones(int(cu[-1]), dtype=torch.bool)
    mode = cfg_sub.get("cross_segment", "paper")
    rr = torch.tensor([rewards[rid] for rid in sessions])
    place = "stitched" if mode == "stitched" else "paper"
    kw = dict(gamma=gamma, cross_segment=mode, lam=cfg_sub.get("lam", "adaptive"))
    r = crf.place_final_rewards(rr, loss_mask, cu, per, mode=place)
    r64 = ref.place_final_rewards(rr.double(), loss_mask, cu, per, mode=place)
    if kl_beta is not None:
        kl = torch.cat([(tq.rows[f"{rid}_{p}"]["old_log_probs"] - tq.rows[f"{rid}_{p}"]["ref_log_prob"])[m]
                        for (rid, p), m in zip(rows, masks)])
        r, r64 = r - kl_beta * kl, r64 - kl_beta * kl.double()
    adv, ret = crf.segment_gae(r, vals, loss_mask, cu, per, **kw)
    adv64, ret64 = ref.segment_gae(r64, vals.double(), loss_mask, cu, per, **kw)
    out = {}
    for j, (rid, p) in enumerate(rows):
        a, b = int(cu[j]), int(cu[j + 1])
        out[f"{rid}_{p}"] = (adv[a:b], ret[a:b], adv64[a:b], ret64[a:b])
    return out


@pytest.mark.parametrize("seed,sub", [(0, {}), (1, {"cross_segment": "stitched"}), (2, {"lam": 0.9, "gamma": 0.99}),
                                      (3, {"cross_segment": "none"})])
def test_trainer_mode_compute_advantage_on_verl_layout(tq, seed, sub):
    keys, rewards = _verl_batch(tq, seed)
    gamma = sub.get("gamma", 1.0)
    cfg = _config(**dict(sub))
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    _trainer(cfg)._compute_advantage(batch, metrics={})
    want = _expected(tq, keys, rewards, {k: v for k, v in sub.items() if k != "gamma"}, gamma)
    for k in keys:
        row = tq.rows[k]
        m = row["response_mask"].bool()
        a, r, a64, r64 = want[k]
        torch.testing.assert_close(row["advantages"][m], a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(row["returns"][m], r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(row["advantages"][m].double(), a64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row["returns"][m].double(), r64, rtol=1e-5, atol=1e-5)
        assert not row["advantages"][~m].any() and not row["returns"][~m].any()


def test_trainer_mode_puts_the_recipe_numbers_into_verl_metrics(tq):
    keys, _ = _verl_batch(tq, 4, prompts=4)
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    metrics = {}
    _trainer(_config())._compute_advantage(batch, metrics=metrics)
    ids, _ = session_rows(keys)
    per = [ids.count(r) for r in sorted(set(ids))]
    assert metrics["compaction/rollouts"] == len(per)
    assert metrics["compaction/segments_per_rollout/mean"] == pytest.approx(sum(per) / len(per))
    assert metrics["compaction/compactions_per_rollout/max"] == max(per) // 2
    assert metrics["compaction/finish_reason/done"] == 1.0
    assert 0 < metrics["compaction/cross_segment_scale/min"] <= metrics["compaction/cross_segment_scale/mean"] <= 1
    share = sum(v for k, v in metrics.items() if k.startswith("compaction/trainable_tokens_share/"))
    assert share == pytest.approx(1.0)
    from compactionrl_fast.rollout.metrics import names

    kinds = {k.split("/")[2] for k in metrics if k.startswith("compaction/trainable_tokens_share/")}
    assert {k for k in metrics if k.startswith("compaction/")} == names(kinds=kinds, reasons=("done",))


@pytest.mark.parametrize("field,delta", [("values", -1), ("values", 1), ("rm_scores", -1)])
def test_trainer_mode_rejects_a_row_of_another_length(tq, field, delta):
    """A row whose per-token field is shorter or longer than its response raises, also when the padded
    batch would still line up (the longest row unchanged)."""
    keys, _ = _verl_batch(tq, 6, prompts=2)
    lens = {k: tq.rows[k]["response_mask"].numel() for k in keys}
    k = min(keys, key=lens.get)
    row = tq.rows[k]
    row[field] = row[field][:-1] if delta < 0 else torch.cat([row[field], row[field][-1:]])
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    want = rf"^{field}: row '{k}' has {lens[k] + delta} values for a response of {lens[k]} tokens"
    with pytest.raises(ValueError, match=want):
        _trainer(_config())._compute_advantage(batch, metrics={})


def test_trainer_mode_with_kl_in_reward(tq):
    """verl's KL penalty (algorithm.use_kl_in_reward) stays per token; the reward is still counted once."""
    from verl.trainer.ppo import core_algos

    keys, rewards = _verl_batch(tq, 9)
    g = torch.Generator().manual_seed(9)
    for row in tq.rows.values():
        row["ref_log_prob"] = row["old_log_probs"] + 0.05 * torch.randn(row["old_log_probs"].shape, generator=g)
    cfg = _config()
    cfg.algorithm.use_kl_in_reward, cfg.algorithm.kl_penalty, cfg.algorithm.kl_ctrl.kl_coef = True, "kl", 0.5
    t = _trainer(cfg)
    t.kl_ctrl_in_reward = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
    metrics = {}
    t._compute_advantage(v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys)), metrics)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    want = _expected(tq, keys, rewards, {}, 1.0, kl_beta=0.5)
    for k in keys:
        m = tq.rows[k]["response_mask"].bool()
        torch.testing.assert_close(tq.rows[k]["advantages"][m], want[k][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(tq.rows[k]["advantages"][m].double(), want[k][2], rtol=1e-5, atol=1e-5)
        assert "token_level_rewards" in tq.rows[k]


def test_trainer_mode_keeps_sync_behaviour_and_corrected_target(tq):
    t = object.__new__(v1.get_trainer_cls("compaction_sync"))
    t.trainer_mode = "compaction_sync"  # what PPOTrainer.__init__ assigns
    assert t.trainer_mode == "sync" and t.registered_mode == "compaction_sync"
    assert issubclass(type(t), v1.PPOTrainerSync)
    assert t._reissue_inflight_prompts() == 0  # verl's own sync branch (an async mode would read tq.kv_list)
    keys, rewards = _verl_batch(tq, 7)
    cfg = _config(critic_target="corrected")
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    _trainer(cfg)._compute_advantage(batch, metrics={})
    for k in keys:
        row = tq.rows[k]
        m = row["response_mask"].bool()
        torch.testing.assert_close(row["returns"][m], row["advantages"][m] + row["values"][m])


def test_padding_rows_get_zero(tq):
    """verl's multi-output padding (upsample_batch_to_divisible_size: keys pad<hex>_<i>_0, a response of one
    token with mask 0, the first row's other fields, tag is_padding): zero advantages, not in the metrics."""
    keys, _ = _verl_batch(tq, 4, prompts=1)
    template = dict(tq.rows[keys[0]])
    for i in range(3):
        tq.rows[f"padabc_{i}_0"] = dict(template, response_mask=torch.zeros(1, dtype=torch.int64),
                                        rm_scores=torch.zeros(1), rollout_log_probs=torch.zeros(1),
                                        old_log_probs=torch.randn(1), values=torch.randn(1), uid="padabc")
    tags = [{}] * len(keys) + [{"is_padding": True}] * 3
    keys = keys + [f"padabc_{i}_0" for i in range(3)]
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=tags)
    metrics = {}
    _trainer(_config())._compute_advantage(batch, metrics=metrics)
    for i in range(3):
        assert not tq.rows[f"padabc_{i}_0"]["advantages"].any()
    assert metrics["compaction/rollouts"] == len(set(session_rows(keys[:-3])[0]))


def test_old_adapter_on_v1_path_refuses(tq, monkeypatch):
    """Regression: patch_compute_advantage() on the V1 path chained every session of a prompt into one
    rollout (only uid reached it) and counted verl's reward copies k times. It now refuses there."""
    from compactionrl_fast.integrations.verl import adapter as V

    keys, _ = _verl_batch(tq, 5)
    for name in V._TRAINER_MODULES:  # restored after the test
        mod = sys.modules.get(name)
        if mod is not None:
            monkeypatch.setattr(mod, "compute_advantage", mod.compute_advantage)
    assert V.patch_compute_advantage("verl.trainer.ppo.v1.utils")
    t = object.__new__(v1.get_trainer_cls("sync"))  # verl's own sync trainer
    t.config = _config()
    t.config.algorithm.adv_estimator = "compaction_gae"
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    with pytest.raises(ValueError, match="compaction_sync"):
        t._compute_advantage(batch, metrics={})


def test_trainer_mode_differs_from_uid_chaining(tq):
    """The two bugs' numbers: sessions chained by uid and every row's reward copy counted (stitched)
    differ from the trainer mode's on rows before a session's last."""
    keys, rewards = _verl_batch(tq, 6)
    td = tq.kv_batch_get(keys, "train", ["response_mask", "rm_scores", "values"]).to_padded_tensor()
    ours, _ = compaction_advantages(keys, td["rm_scores"], td["values"], td["response_mask"],
                                    {"compaction_gae": {"cross_segment": "stitched"}})
    from compactionrl_fast.integrations.padded import segment_gae_padded

    uids = [k.rsplit("_", 2)[0] for k in keys]  # what the old adapter saw: the prompt only, rows in batch order
    old, _ = segment_gae_padded(td["rm_scores"], td["values"], td["response_mask"].bool(), uids,
                                cross_segment="stitched", gamma=1.0, lam="adaptive")
    assert not torch.allclose(ours, old)


def test_bad_input_names_the_key():
    m = torch.ones(3, 4)
    s = torch.zeros(3, 4)
    s[:, -1] = 1.0
    v = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="appears twice"):
        compaction_advantages(["u_0_0", "u_0_0", "u_1_0"], s, v, m)
    with pytest.raises(ValueError, match="missing"):
        compaction_advantages(["u_0_0", "u_0_2", "u_1_0"], s, v, m)
    with pytest.raises(ValueError, match="not verl's"):
        compaction_advantages(["u0", "u_0_1", "u_1_0"], s, v, m)
    s2 = s.clone()
    s2[1, -1] = 2.0
    with pytest.raises(ValueError, match="different rewards"):
        compaction_advantages(["u_0_0", "u_0_1", "u_1_0"], s2, v, m)
    with pytest.raises(ValueError, match="values"):
        compaction_advantages(["u_0_0", "u_0_1", "u_1_0"], s, torch.zeros(3, 5), m)
    with pytest.raises(ValueError, match="critic_target"):
        compaction_advantages(["u_0_0", "u_0_1", "u_1_0"], s, v, m, {"compaction_gae": {"critic_target": "x"}})
    for key, bad in (("lam", "adaptiv"), ("lam", "Adaptive"), ("lam", 1.5), ("cross_segment", "papr"),
                     ("adaptive_length", "x"), ("lam_critic", 2.0), ("adaptive_alpha", 0.0)):
        with pytest.raises(ValueError, match=rf"^algorithm\.compaction_gae\.{key}: "):
            compaction_advantages(["u_0_0", "u_0_1", "u_1_0"], s, v, m, {"compaction_gae": {key: bad}})
    with pytest.raises(ValueError, match=r"^algorithm\.gamma: "):
        compaction_advantages(["u_0_0", "u_0_1", "u_1_0"], s, v, m, {"gamma": 1.5})


def test_compaction_metrics_by_hand():
    """Two rollouts (exec 3, summary 2, exec 1 trainable tokens; exec 2), rows shuffled, one padding row,
    lam 0.5: the cross-segment scales are 0.5^3, 0.5^1, 1 and 1."""
    rows = {"a_0_0": (3, "exec"), "a_0_1": (2, "summary"), "a_0_2": (1, "exec"), "b_0_0": (2, "exec")}
    keys = ["a_0_2", "b_0_0", "pad_0_0", "a_0_0", "a_0_1"]
    mask = torch.zeros(5, 4)
    extra = []
    for i, k in enumerate(keys):
        if k == "pad_0_0":
            extra.append(None)
            continue
        n, kind = rows[k]
        mask[i, 4 - n:] = 1  # trainable tokens at the end, an observation before
        extra.append({"segment_kind": kind, "compactions": 1 if k[0] == "a" else 0,
                      "finish_reason": "done" if k[0] == "a" else "truncated"})
    m = compaction_metrics(keys, mask, extra, {"compaction_gae": {"lam": 0.5}})
    want = {"compaction/rollouts": 2, "compaction/compactions_per_rollout/mean": 0.5,
            "compaction/compactions_per_rollout/max": 1, "compaction/segments_per_rollout/mean": 2,
            "compaction/segments_per_rollout/max": 3, "compaction/summary_tokens_per_rollout/mean": 1,
            "compaction/summary_tokens_per_rollout/max": 2,
            "compaction/trainable_tokens_per_segment/exec/mean": 2, "compaction/trainable_tokens_share/exec": 0.75,
            "compaction/trainable_tokens_per_segment/summary/mean": 2,
            "compaction/trainable_tokens_share/summary": 0.25,
            "compaction/cross_segment_scale/mean": (0.125 + 0.5 + 1 + 1) / 4,
            "compaction/cross_segment_scale/min": 0.125,
            "compaction/finish_reason/done": 0.5, "compaction/finish_reason/truncated": 0.5}
    assert m == pytest.approx(want)
    assert compaction_metrics(keys, mask, [None] * 5) == {}


def test_compaction_metrics_keys_are_exactly_the_vocabularys():
    """The names of rollout.metrics.VOCABULARY (docs/metrics.md) for the rows seen, the vocabulary's own numbers
    of the rows' facts; the per-kind names only for the kinds present."""
    from compactionrl_fast.rollout.metrics import SegmentFact, names
    from compactionrl_fast.rollout.metrics import compaction_metrics as vocabulary_metrics

    keys = ["a_0_1", "a_0_0", "b_0_0", "pad_0_0"]
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
    extra = [{"segment_kind": "exec", "compactions": 0, "finish_reason": "max_turns"}] * 2 \
        + [{"segment_kind": "exec", "compactions": 0, "finish_reason": "done"}, {"is_padding": True}]
    m = compaction_metrics(keys, mask, extra, {"gamma": 0.9})
    assert set(m) == names(kinds=("exec",), reasons=("done", "max_turns"))
    facts = [SegmentFact("a_0", 1, "exec", 2, 0, "max_turns"), SegmentFact("a_0", 0, "exec", 3, 0, "max_turns"),
             SegmentFact("b_0", 0, "exec", 1, 0, "done")]
    assert m == pytest.approx(vocabulary_metrics(facts, {"gamma": 0.9}))
    assert m["compaction/cross_segment_scale/min"] == pytest.approx(0.9 ** 2 * (1 - 1 / (1.5 * 5)) ** 2)


def test_trainer_mode_rejects_other_estimators(tq):
    keys, _ = _verl_batch(tq, 8, prompts=1)
    cfg = _config()
    cfg.algorithm.adv_estimator = "grpo"
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        _trainer(cfg)._compute_advantage(batch, metrics={})


def test_plugin_discovered_by_import_verl():
    """A fresh process: `import verl` loads the entry point (installed metadata); checked on verl's
    registries, since verl swallows a plug-in's exception."""
    code = ("import verl\n"
            "from verl.trainer.ppo.v1 import get_trainer_cls\n"
            "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry\n"
            "from verl.trainer.ppo import core_algos\n"
            "print(get_trainer_cls('compaction_sync').__name__)\n"
            "print(_agent_loop_registry['compaction_agent']['_target_'])\n"
            "print('compaction_gae' in core_algos.ADV_ESTIMATOR_REGISTRY, 'compaction' in core_algos.POLICY_LOSS_REGISTRY)\n")
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto")
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:] + "\n(is the package installed with its entry point? "\
        "pip install --no-deps --no-build-isolation -e .)"
    lines = out.stdout.split("\n")[-4:-1]
    assert lines == ["CompactionSyncTrainer", "compactionrl_fast.integrations.verl.agent_loop.CompactionAgentLoop",
                     "True True"], out.stdout
    assert verl_plugin.ERRORS == {} and set(verl_plugin.REGISTERED) == {"ops", "agent_loop", "trainer"}


@pytest.mark.parametrize("key", [None, True, False])
def test_the_ablation_key_takes_summaries_out_of_the_actors_update(tq, monkeypatch, key):
    """`+compaction.train_summary_tokens=false`: while verl's actor update runs, the summary rows' response_mask
    and loss_mask (what verl's loss reads and counts tokens with) are 0, the execution rows' unchanged (our
    trainer's policy mask); after it, every mask is back (the critic, GAE and metrics saw and see them all).
    Unset or true: the update sees the masks as they are."""
    keys, _ = _verl_batch(tq, 9)
    before = {k: (tq.rows[k]["response_mask"].clone(), tq.rows[k]["loss_mask"].clone()) for k in keys}
    kinds = {k: tq.rows[k]["extra_fields"]["segment_kind"] for k in keys}
    assert set(kinds.values()) == {"exec", "summary"}
    seen = {}

    def update(self, batch, metrics):  # verl's own update: what its actor workers would read from TransferQueue
        seen.update({k: (tq.rows[k]["response_mask"].clone(), tq.rows[k]["loss_mask"].clone()) for k in batch.keys})
        return batch

    monkeypatch.setattr(v1.trainer_base.PPOTrainer, "_update_actor", update)
    cfg = _config()
    if key is not None:
        cfg.compaction = {"train_summary_tokens": key}
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    _trainer(cfg)._update_actor(batch, {})
    for k in keys:
        out = key is False and kinds[k] == "summary"
        for got, was in zip(seen[k], before[k]):
            assert torch.equal(got, torch.zeros_like(was) if out else was), (k, kinds[k])
        assert torch.equal(tq.rows[k]["response_mask"], before[k][0]) and torch.equal(tq.rows[k]["loss_mask"], before[k][1])
    assert any(kinds[k] == "summary" and before[k][0].any() for k in keys)


def test_the_ablation_key_must_be_a_bool(tq):
    keys, _ = _verl_batch(tq, 2)
    cfg = _config()
    cfg.compaction = {"train_summary_tokens": "no"}
    batch = v1.trainer_base.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    with pytest.raises(ValueError, match="compaction.train_summary_tokens must be true or false, got 'no'"):
        _trainer(cfg)._update_actor(batch, {})
