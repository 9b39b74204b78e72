"""Command line: `python -m compactionrl_fast {demo,train,plot,bench}` (also `compactionrl-fast ...`).

    demo   the CPU demo on the built-in memory task: SFT -> CompactionRL -> ablation -> evaluation
    train  SFT (if sft.steps > 0) then PPO with compaction on the built-in task, from YAML/flags;
           runs under `torchrun --nproc-per-node N` (gloo on CPU, NCCL on GPU)
    plot   render RUN_DIR/metrics.jsonl to PNG files in RUN_DIR/plots/
    bench  the op benchmarks (`python -m benchmarks ARGS`)
"""
from __future__ import annotations

import argparse
import subprocess
import sys


def _demo(argv):
    from . import demo
    from .train.config import add_arguments, demo_config, from_args

    p = argparse.ArgumentParser(prog="compactionrl-fast demo", description=demo.__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the full method (default: 0)")
    p.add_argument("--no-ablation", action="store_true", help="skip the summary-tokens-masked ablation")
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=None,
                   help="seeds that also run the ablation (default: the first seed)")
    p.add_argument("--out", default="benchmarks/results", help="folder of demo_cpu.json / demo_cpu.md")
    p.add_argument("--name", default="demo_cpu", help="file name stem of the results")
    add_arguments(p, demo_config())
    args = p.parse_args(argv)
    cfg = from_args(args, demo_config())
    ablation_seeds = [] if args.no_ablation else (args.ablation_seeds or args.seeds[:1])
    demo.run(cfg, seeds=args.seeds, ablation_seeds=ablation_seeds, eval_rollouts=cfg.eval_rollouts,
             out_dir=args.out, name=args.name, argv=["demo"] + list(argv))
    return 0


def _train(argv):
    from . import demo
    from .train.config import TrainConfig, add_arguments, from_args

    p = argparse.ArgumentParser(prog="compactionrl-fast train", description="SFT then PPO with compaction "
                                "(the paper's defaults; see --config and --set)")
    p.add_argument("--no-resume", action="store_true", help="start over even if RUN_DIR has a checkpoint")
    add_arguments(p, TrainConfig())
    args = p.parse_args(argv)
    cfg = from_args(args, TrainConfig())
    demo.train(cfg, resume=not args.no_resume)
    return 0


def _plot(argv):
    from .train.plots import plot_run

    p = argparse.ArgumentParser(prog="compactionrl-fast plot", description="render a run's metrics to PNG")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    args = p.parse_args(argv)
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _bench(argv):
    return subprocess.call([sys.executable, "-m", "benchmarks", *argv])


COMMANDS = {"demo": _demo, "train": _train, "plot": _plot, "bench": _bench}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])
