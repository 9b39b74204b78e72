"""Where the demo's time goes, by operator: SFT steps and PPO steps of the demo's recipe at 1 thread.

    python benchmarks/experiments/profile_demo_steps.py [--sft-steps 40] [--rl-steps 3] [--top 15]
    MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/experiments/profile_demo_steps.py

The SFT part trains `--sft-steps` steps (so the rollouts that follow have the demo's lengths) and profiles the
last `--profile-steps` of them; the RL part profiles `fit` over `--rl-steps` PPO steps (rollouts with the
embedded engine, then the PPO update) from those weights. Prints torch.profiler's table by self CPU time and the
wall time per step.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def table(prof, top: int) -> str:
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft-steps", type=int, default=40)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from torch.profiler import ProfilerActivity, profile

    from compactionrl_fast.app.demo import demo_config
    from compactionrl_fast.app.runner import build, run_rl, run_sft, task
    from compactionrl_fast.train.config_load import update

    env = {k: os.environ.get(k) for k in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    print(f"torch {torch.__version__}, 1 thread, {env}, load {os.getloadavg()[0]:.1f}")
    print(torch.__config__.show().split("\n")[-2][:200])
    with tempfile.TemporaryDirectory() as d:
        cfg = demo_config(threads=1, run_dir=d, progress=False, steps=a.rl_steps, value_pretrain_steps=0)
        cfg = update(cfg, {"sft.steps": a.sft_steps - a.profile_steps})
        tok, make_envs, rcfg = task(cfg)
        actor = build(cfg, tok)
        run_sft(cfg, actor, tok, make_envs, rcfg, progress=False)
        prof_cfg = update(cfg, {"sft.steps": a.profile_steps})
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            run_sft(prof_cfg, actor, tok, make_envs, rcfg, progress=False)
            sft_s = (time.perf_counter() - t) / a.profile_steps
        print(f"\n== SFT: {sft_s * 1e3:.0f} ms per step ({cfg.sft.rollouts_per_step} expert rollouts + update)")
        print(table(prof, a.top))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            run_rl(cfg, actor, tok, make_envs, rcfg, progress=False)
            rl_s = (time.perf_counter() - t) / a.rl_steps
        print(f"\n== RL: {rl_s * 1e3:.0f} ms per PPO step ({cfg.rollouts_per_step} rollouts + update, critic "
              "built and saved once)")
        print(table(prof, a.top))
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
