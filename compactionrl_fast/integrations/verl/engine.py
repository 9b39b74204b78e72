"""An `Engine` over verl's `server_manager`: how the compaction loop samples on verl's rollout servers."""
from __future__ import annotations

from ...rollout.engines.base import Engine, Generation, caps_list


class ServerManagerEngine(Engine):
    """An `Engine` over verl's `server_manager` (`LLMServerClient`): each prompt of a round is one
    `await server_manager.generate(request_id, prompt_ids=..., sampling_params=...)`, all of a round
    concurrently. `generate` returns a coroutine, which `arun_rollouts` awaits.

    Args:
        server_manager: verl's client (anything with that async `generate`).
        sampling_params: verl's per-sample dict (temperature, top_p, top_k, ...); `max_tokens`,
            `stop_token_ids`, `logprobs` and a seed are set per request from the loop's arguments.
        request_id: the session's sticky id (every call of a rollout goes to the same server, which keeps
            its prefix cache); round-robin between rollouts is verl's.
    """

    def __init__(self, server_manager, sampling_params=None, request_id="compaction"):
        if not callable(getattr(server_manager, "generate", None)):
            raise TypeError(f"server_manager must have an async generate(), got {type(server_manager).__name__}")
        self.server_manager = server_manager
        self.sampling_params = dict(sampling_params or {})
        self.request_id = str(request_id)
        self.global_steps = None  # (first, last) weight version the servers reported, over every call

    def _saw_steps(self, extra):
        """Track the weight versions (verl's `min_global_steps` / `max_global_steps`) of one server output."""
        lo = extra.get("min_global_steps", extra.get("global_steps"))
        hi = extra.get("max_global_steps", extra.get("global_steps"))
        if lo is None or hi is None:
            return
        if self.global_steps is None:
            self.global_steps = (int(lo), int(hi))
        else:
            self.global_steps = (min(self.global_steps[0], int(lo)), max(self.global_steps[1], int(hi)))

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        """Coroutine of `Engine.generate`: verl's sampling params win over the loop's temperature/top_p
        (validation sets its own); the loop's caps and stop tokens are always applied."""
        import asyncio

        caps = caps_list(max_new_tokens, len(prompts))
        keys = cache_keys if cache_keys is not None else range(len(prompts))

        async def one(prompt, cap, key):
            params = dict(self.sampling_params)
            params.setdefault("temperature", temperature)
            params.setdefault("top_p", top_p)
            params.update(max_tokens=cap, stop_token_ids=list(stop_token_ids), logprobs=True)
            if seed is not None:
                params["seed"] = int(seed)
            out = await self.server_manager.generate(f"{self.request_id}-{key}", prompt_ids=list(prompt),
                                                     sampling_params=params)
            ids = list(out.token_ids)
            lps = getattr(out, "log_probs", None)
            if lps is None or len(lps) != len(ids):
                raise ValueError("server_manager.generate returned no per-token log_probs (or a wrong number); "
                                 "the compaction agent loop needs them (actor_rollout_ref.rollout.calculate_log_probs)")
            self._saw_steps(getattr(out, "extra_fields", None) or {})
            stopped = bool(ids) and ids[-1] in stop_token_ids
            return Generation(ids, [float(x) for x in lps], "stop" if stopped else "length")

        async def all_of():
            return list(await asyncio.gather(*(one(p, c, k) for p, c, k in zip(prompts, caps, keys))))

        return all_of()

    def load_weights(self, state_dict) -> None:
        raise NotImplementedError("verl syncs the servers' weights itself (checkpoint_manager.update_weights)")
