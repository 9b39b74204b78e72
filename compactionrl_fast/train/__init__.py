"""The trainer around the ops: configuration, models, the PPO step and the loop that runs it.

config: the dataclasses of a run, their checks and help (one table of fields); config_load: loading them from
mappings, YAML and flags. model: actor and critic and their packed forward. micro_batch: a micro-batch's
layout, derived once per step.
trainer: the PPO step (`train_step`). readout: the step's metrics, read from the device once.
diagnostics: per-step statistics the paper does not report. loop: rollouts -> step -> logs and
checkpoints (`fit`). log: metrics.jsonl. dist: distributed helpers. atomic: atomic file writes. checkpoint,
sft, sync, engines, threads: as named. The command line, demo and plots are in compactionrl_fast/app/.

Nothing is imported here: `import compactionrl_fast` stays free of transformers and the trainer.
"""
