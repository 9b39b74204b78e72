"""VLLMEngine: in-process vLLM `LLM` for GPU rollouts (optional dependency, imported lazily).

Prompts go in as token ids (TokensPrompt), so nothing is re-tokenised; each sampled token comes back with
its log-prob. `logprobs_mode="processed_logprobs"` makes vLLM return log-probs of the distribution it
samples from (after temperature), the same quantity the trainer computes as log_softmax(logits / T)
(with top_p < 1 vLLM's processed log-probs are those of the truncated distribution; keep top_p = 1 for
exact PPO ratios). Weight updates load the trainer's state dict into the worker's model in place.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the caller set it): weight
updates go through `LLM.apply_model`, which in vLLM's default engine-core subprocess would have to pickle
the closure and every weight tensor (refused unless VLLM_ALLOW_INSECURE_SERIALIZATION=1). With
tensor_parallel_size > 1 the workers are processes anyway: set VLLM_ALLOW_INSECURE_SERIALIZATION=1 there.
Checked against vLLM 0.33's API by tests/integrations/test_vllm_api.py.
"""
from __future__ import annotations

from .base import Engine, Generation, caps_list


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 -- any import failure means "not usable here"
        return False
    return True


class VLLMEngine(Engine):
    """Generation engine around `vllm.LLM` in this process.

    Args:
        model: a local model directory (or anything `vllm.LLM(model=...)` accepts).
        enable_sleep_mode: lets `sleep()`/`wake()` release and restore GPU memory between rollout phases.
        logprobs_mode: vLLM's log-prob mode (see the module docstring); dropped on vLLM versions without it.
        llm_kwargs: passed to `vllm.LLM` (gpu_memory_utilization, dtype, max_model_len, seed, ...).
    """

    def __init__(self, model: str, *, enable_sleep_mode: bool = True, logprobs_mode: str = "processed_logprobs",
                 **llm_kwargs):
        import inspect
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see the module docstring
        from vllm import LLM

        kw = dict(model=model, enable_sleep_mode=enable_sleep_mode, **llm_kwargs)
        try:
            accepted = inspect.signature(LLM.__init__).parameters
            from vllm.engine.arg_utils import EngineArgs
            accepted = set(accepted) | set(inspect.signature(EngineArgs).parameters)
        except Exception:  # noqa: BLE001
            accepted = {"logprobs_mode"}
        if "logprobs_mode" in accepted:
            kw["logprobs_mode"] = logprobs_mode
        self.llm = LLM(**kw)
        self._asleep = False

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        caps = caps_list(max_new_tokens, len(prompts))
        out = [Generation([], [], "length") for _ in prompts]
        rows = [i for i, c in enumerate(caps) if c > 0]
        if not rows:
            return out
        params = [SamplingParams(temperature=float(temperature), top_p=float(top_p), max_tokens=caps[i],
                                 stop_token_ids=list(stop_token_ids), logprobs=0, detokenize=False,
                                 skip_special_tokens=False, ignore_eos=False,
                                 seed=None if seed is None else int(seed) + i) for i in rows]
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
        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(lambda model: model.load_weights(iter(items)))
        else:  # older vLLM, single in-process worker
            self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(iter(items))
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def sleep(self, level: int = 1) -> None:
        if hasattr(self.llm, "sleep") and not self._asleep:
            self.llm.sleep(level=level)
            self._asleep = True

    def wake(self) -> None:
        if hasattr(self.llm, "wake_up") and self._asleep:
            self.llm.wake_up()
            self._asleep = False
