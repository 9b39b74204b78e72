"""The trainer's side of the engines: weight sync and the sampler-vs-learner guard.

An engine that holds its own copy of the weights (vLLM) samples from the policy of its last
`load_weights`; the trainer pushes the actor's weights to it at the start of RL (after SFT, after a
resume) and after every actor update. The guard then checks what the sync is for: the log-probs the
engine reported for the sampled tokens must equal the trainer's own log-probs of the same tokens before
the step's update (`sampler/logp_absdiff_max`), within `sampler_logp_tol`.
"""
from __future__ import annotations

import math
import time


class SamplerMismatchError(RuntimeError):
    """The rollout log-probs and the trainer's recomputed log-probs disagree beyond `sampler_logp_tol`."""


def push_weights(engine, actor) -> float:
    """Load `actor`'s weights into `engine` unless it generates with them already; seconds taken (0 if not)."""
    if engine.shares_weights(actor):
        return 0.0
    t = time.perf_counter()
    engine.load_weights(actor.state_dict())
    return time.perf_counter() - t


def check_sampler(gap, tol, step: int, engine, actor=None) -> None:
    """Raise SamplerMismatchError when `gap` (max |trainer - sampler| log-prob) is not within `tol`
    (None: the guard is off). NaN fails. With several replicas (an engine with `replica_gaps`, e.g.
    ServerEngine) and `actor`, the message gives each replica's gap on a probe completion."""
    if tol is None or gap is None or gap <= tol:
        return
    per = ""
    if actor is not None and callable(getattr(engine, "replica_gaps", None)):
        try:
            gaps = engine.replica_gaps(actor)
        except Exception as e:  # noqa: BLE001 -- the guard's own error comes first
            gaps = {"(probe failed)": f"{type(e).__name__}: {e}"}
        if gaps:
            per = " Per replica (max gap on a probe completion): " + "; ".join(
                f"{u}: {g:.3g}" + (" > tol" if g > tol else "") if isinstance(g, float) else f"{u}: {g}"
                for u, g in gaps.items()) + "."
    raise SamplerMismatchError(
        f"sampler-vs-learner gap at step {step}: max |trainer log-prob - rollout log-prob| = "
        f"{gap if math.isfinite(gap) else gap!r} > sampler_logp_tol = {tol} over the step's trainable tokens "
        f"(engine {type(engine).__name__}). The engine is not sampling from the trainer's policy. Likely causes: "
        "(1) its weights were not synced after an update (an engine whose shares_weights() says True without "
        "sharing the parameters, or a load_weights that does not take effect); (2) a different model or dtype in "
        "the engine (a bfloat16 engine needs a looser tolerance, see docs/config.md); (3) an engine bug or "
        "log-probs of another distribution (temperature, top_p < 1, vLLM's logprobs_mode). Set "
        "sampler_logp_tol: null to train anyway." + per)
