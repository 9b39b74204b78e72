"""slime's advantage step on agent rollouts: its built-in `ppo` estimator against
`compactionrl_fast.integrations.slime.compute_advantages`, both called through slime's real
`compute_advantages_and_returns` on the same `rollout_data`, and how far slime's numbers are from the right ones.

    make test-slime          # builds build/slime-venv (slime snapshot, megatron-core) first
    build/slime-venv/bin/python benchmarks/bench_slime.py [--quick] [--json PATH]

The batch is what slime hands the trainer for compacted agent rollouts: R rollouts of 4 segments each
(exec, summary, exec, summary), one sample per segment, ~70% trainable tokens (assistant runs ~140 tokens,
observation runs ~60), critic values, log-probs and reference log-probs (`--kl-coef 0.01`, k1), one
process (world 1, megatron-core's parallel state over gloo), 1 thread. Rows, interleaved round by round:

- "slime ppo": `--advantage-estimator ppo` (`get_advantages_and_returns_batch`: padded [B, max_len], every
  response token a time step, the reward added to the last response token), gamma 1, lambd 0.95;
- "ours, lam 0.95 none": our function with the same gamma and lambda and no cross-segment factor
  (`compaction_cross_segment: none`): what slime's estimator means, done on the trainable tokens;
- "ours, paper": the paper's recipe (adaptive lambda, cross-segment factor, lam_critic 1);
- "... estimator only": the same without slime's per-sample KL computation both rows share (KL precomputed).
- "floor: cat + split of the lists": one torch.cat per input list and one split per output, what any estimator
  over slime's per-sample lists pays; "place + GAE on packed tensors": our two ops on the batch already packed.

Errors, over trainable tokens: each row against the float64 reference of its own recipe
(`compactionrl_fast.reference.gae`), and slime's advantages against the float64 reference of
"lam 0.95 none" (the same hyper-parameters, observations skipped, the reward once on the last trainable
token) and of the paper's recipe.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _harness as H  # noqa: E402

ADV_FN = "compactionrl_fast.integrations.slime.compute_advantages"
SHAPES = {"128x1024": (128, 1024), "128x8192": (128, 8192)}
QUICK = {"16x1024": (16, 1024)}


def _stub_sglang():
    """slime's imports bind sglang names at import time; CPU machines have no sglang (as slime's CPU tests)."""
    sys.path.insert(0, os.path.join(H.REPO, "tests", "integrations", "slime"))
    import _stubs

    _stubs.install()


def batch(R, tokens, seed=0):
    """rollout_data as process_rollout_data leaves it (one DP rank holding everything), plus the critic's
    values and the log-probs; and the packed layout (mask, cu_seqlens, cu_segments) for the references."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rd = {k: [] for k in ("loss_masks", "response_lengths", "total_lengths", "rewards", "rollout_ids",
                          "round_number", "partition", "values", "log_probs", "ref_log_probs")}
    for r in range(R):
        reward = rng.choice([0.0, 1.0])
        for k in range(4):
            n = tokens // 4
            mask = []
            while len(mask) < n:
                mask += [1] * max(1, int(rng.expovariate(1 / 140))) + [0] * int(rng.expovariate(1 / 60))
            mask = mask[:n]
            mask[0] = 1
            prompt = rng.randint(16, 256)
            rd["loss_masks"].append(torch.tensor(mask, dtype=torch.int32))
            rd["response_lengths"].append(n)
            rd["total_lengths"].append(prompt + n)
            rd["rewards"].append(reward)
            rd["rollout_ids"].append(r)
            rd["round_number"].append(k)
            rd["partition"].append(len(rd["partition"]))
            rd["values"].append(torch.randn(n, generator=g) * 0.1 + 0.5)
            rd["log_probs"].append(-torch.rand(n, generator=g))
            rd["ref_log_probs"].append(-torch.rand(n, generator=g))
    return rd


FLOOR = "floor: cat + split of the lists"
OPS = "place + GAE on packed tensors"


def floor(rd):
    """What any estimator over slime's per-sample lists pays: one cat per input key (loss_masks, values, kl)
    and one split per output (advantages, returns) back into per-sample tensors."""
    lengths = rd["response_lengths"]
    torch.cat(rd["loss_masks"])
    torch.cat(rd["values"]).split(lengths)
    torch.cat(rd["kl"]).split(lengths)


def ops_only(rd, **gae):
    """place_final_rewards + segment_gae(**gae) on the batch already packed (R rollouts of 4 segments)."""
    import compactionrl_fast as crf

    mask = torch.cat(rd["loss_masks"]).bool()
    values = torch.cat(rd["values"])
    cu_seqlens = torch.tensor([0] + list(rd["response_lengths"])).cumsum(0)
    cu_segments = torch.arange(0, len(rd["response_lengths"]) + 1, 4)
    rr = torch.tensor(rd["rewards"][::4], dtype=torch.float32)

    def fn():
        rewards = crf.place_final_rewards(rr, mask, cu_seqlens, cu_segments)
        crf.segment_gae(rewards, values, mask, cu_seqlens, cu_segments, **gae)
    return fn


def slime_args(**kw):
    a = argparse.Namespace(advantage_estimator="ppo", kl_coef=0.01, kl_loss_type="k1", use_rollout_logprobs=False,
                           custom_advantage_function_path=None, use_opd=False, normalize_advantages=False,
                           gamma=1.0, lambd=0.95, partial_rollout=False)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def reference(rd, **gae):
    """float64 reference advantages [T] of the batch (sample order), KL as slime computes it (k1)."""
    from compactionrl_fast.reference.gae import place_final_rewards, segment_gae

    mask = torch.cat(rd["loss_masks"]).bool()
    lengths = torch.tensor(rd["response_lengths"])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    cu_segments = torch.arange(0, len(lengths) + 1, 4)
    rr = torch.tensor(rd["rewards"][::4], dtype=torch.float64)
    mode = "stitched" if gae.get("cross_segment") == "stitched" else "paper"
    kl = torch.cat(rd["log_probs"]).double() - torch.cat(rd["ref_log_probs"]).double()
    rewards = place_final_rewards(rr, mask, cu_seqlens, cu_segments, mode) - 0.01 * kl
    adv, _ = segment_gae(rewards, torch.cat(rd["values"]).double(), mask, cu_seqlens, cu_segments, **gae)
    return adv, mask


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    p.add_argument("--json", default=None, help="write the rows here (and a .md beside)")
    p.add_argument("--budget-s", type=float, default=6.0, help="timing budget per shape, seconds")
    a = p.parse_args()
    torch.set_num_threads(1)
    H.settle_malloc()
    _stub_sglang()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns
    from slime.utils.ppo_utils import get_advantages_and_returns_batch

    from compactionrl_fast.integrations.slime import compute_advantages

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)

    recipes = {
        "slime ppo": (slime_args(), dict(gamma=1.0, lam=0.95, cross_segment="none", lam_critic=None)),
        "ours, lam 0.95 none": (slime_args(custom_advantage_function_path=ADV_FN, compaction_lam=0.95,
                                           compaction_cross_segment="none", compaction_lam_critic=None),
                                dict(gamma=1.0, lam=0.95, cross_segment="none", lam_critic=None)),
        "ours, paper": (slime_args(custom_advantage_function_path=ADV_FN), dict(gamma=1.0, lam="adaptive")),
    }
    env = H.environment("cpu")
    rows = []
    for shape, (R, tokens) in (QUICK if a.quick else SHAPES).items():
        rd = batch(R, tokens)
        T = sum(rd["response_lengths"])
        outs, fns = {}, {}
        for name, (args, _) in recipes.items():
            def fn(args=args, name=name):
                d = dict(rd)
                compute_advantages_and_returns(args, d)
                outs[name] = torch.cat(d["advantages"]).double()
            fn()  # warm-up, and the numbers checked below
            fns[name] = fn
        # the estimators alone, on rollout_data whose KL slime has already computed (the step above minus the
        # per-sample KL both share): slime's ppo branch, as loss.py writes it, and our function
        d0 = dict(rd)
        compute_advantages_and_returns(recipes["ours, paper"][0], d0)
        kl_done = {k: v for k, v in d0.items() if k not in ("advantages", "returns")}

        def slime_estimator():
            rewards = []
            for reward, per_token_kl in zip(kl_done["rewards"], kl_done["kl"]):
                token_level_rewards = per_token_kl * -0.01
                token_level_rewards[-1] += reward
                rewards.append(token_level_rewards)
            get_advantages_and_returns_batch(kl_done["total_lengths"], kl_done["response_lengths"], kl_done["values"],
                                             rewards, 1.0, 0.95)

        fns["slime ppo, estimator only"] = slime_estimator
        fns["ours, paper, estimator only"] = lambda: compute_advantages(recipes["ours, paper"][0], dict(kl_done))
        fns[FLOOR] = lambda: floor(kl_done)
        fns[OPS] = ops_only(kl_done, **recipes["ours, paper"][1])
        for fn in list(fns.values())[-4:]:
            fn()
        timing = H.time_round_robin(fns, torch.device("cpu"), budget_s=a.budget_s)
        refs = {name: reference(rd, **gae) for name, (_, gae) in recipes.items() if name != "slime ppo"}
        for name in ("slime ppo, estimator only", "ours, paper, estimator only", FLOOR, OPS):
            rows.append(dict(shape=shape, name=name, tokens=T, **timing[name], env=env))
        for name in recipes:
            ref_name = "ours, lam 0.95 none" if name == "slime ppo" else name
            exp, mask = refs[ref_name]
            err = (outs[name] - exp)[mask].abs()
            row = dict(shape=shape, name=name, tokens=T, trainable=int(mask.sum()), **timing[name],
                       max_err=float(err.max()), mean_err=float(err.mean()))
            if name == "slime ppo":
                paper, _ = refs["ours, paper"]
                e2 = (outs[name] - paper)[mask].abs()
                row.update(max_err_vs_paper=float(e2.max()), mean_err_vs_paper=float(e2.mean()))
            row["env"] = env
            rows.append(row)
    for r in rows:  # each row against slime's row of the same kind (whole step, or estimator only)
        base = next(b for b in rows if b["shape"] == r["shape"]
                    and b["name"] == ("slime ppo, estimator only" if "estimator" in r["name"] else "slime ppo"))
        r["speedup_vs_slime"] = base["median_ms"] / r["median_ms"]
        if "estimator" in r["name"] or r["name"] in (FLOOR, OPS):  # what our own cost is measured against
            r["x_floor"] = r["median_ms"] / next(b["median_ms"] for b in rows
                                                 if b["shape"] == r["shape"] and b["name"] == FLOOR)
    cols = [("shape", "shape", ""), ("name", "advantage step", ""), ("tokens", "tokens", ","),
            ("median_ms", "median ms", ".2f"), ("min_ms", "min ms", ".2f"), ("cpu_ms", "cpu ms", ".2f"),
            ("speedup_vs_slime", "x slime", ".2f"), ("x_floor", "x floor", ".2f"),
            ("max_err", "max |err| own recipe", ".2e"), ("mean_err", "mean |err|", ".2e"),
            ("max_err_vs_paper", "max |err| vs paper", ".3f"), ("mean_err_vs_paper", "mean |err| vs paper", ".3f")]
    notes = ["time: slime's compute_advantages_and_returns (the per-sample KL, the estimator) per call, 1 thread, "
             "rounds interleaved, medians over rounds (wall; cpu ms: the process's CPU time, which time slices "
             "lost to other processes on a loaded machine do not inflate); x slime: against slime's row of the "
             "same kind",
             "estimator only: the same step on rollout_data whose KL is already computed (both rows share slime's "
             "per-sample KL, compute_approx_kl per sample): slime's ppo branch (token rewards, then "
             "get_advantages_and_returns_batch) against compute_advantages with the paper's options",
             "own recipe: slime ppo against the float64 reference of the same gamma/lambda done on trainable "
             "tokens only (observations skipped, the reward once on the last trainable token); ours against "
             "the float64 reference of its own options",
             "vs paper: slime ppo's advantages against the paper's recipe (adaptive lambda, cross-segment factor)",
             f"{FLOOR!r}: one torch.cat per input (loss_masks, values, kl) and one split per output (advantages, "
             "returns), what any estimator that takes and returns slime's per-sample lists pays; "
             f"{OPS!r}: place_final_rewards + segment_gae (C++) on tensors already packed, the paper's options. "
             "ours minus the floor is our own cost: ordering, checks, the ops",
             "x floor: the row's median over the floor's; an estimator over slime's lists that runs these two ops "
             "cannot go below the floor's x floor plus that of 'place + GAE' (ours adds the mask's bool copy, the "
             "KL term, the per-sample counts and the Python per sample)",
             f"machine load at start {env['loadavg_at_start']} (a shared 2-core VM: absolute times vary, the "
             "ratios were measured in the same rounds)"]
    H.report("slime's advantage step: built-in ppo vs compute_advantages (CPU, 1 thread)", rows, cols, env, notes,
             json_path=a.json)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
