"""verl adapter: the `compaction_gae` advantage estimator and the `compaction` policy loss.

Importing this module registers both through verl's own decorators when verl is importable
(`verl.trainer.ppo.core_algos.register_adv_est` and `register_policy_loss`, verl 0.9). Registries are
per process, so every process that computes advantages or losses (the driver and the Ray workers)
must import it; verl does that for you at `import verl` with

    VERL_USE_EXTERNAL_MODULES=compactionrl_fast.integrations.verl

(an environment variable read in `verl/__init__.py`; pass it to the workers too, e.g. through Ray's
runtime_env env_vars).

Config (hydra overrides on verl's PPO trainer):

    algorithm.adv_estimator=compaction_gae
    critic.enable=True                       # verl turns the critic on by itself only for "gae"
    algorithm.gamma=1.0                      # verl's key; the package default is 1.0
    +algorithm.compaction_gae.lam=adaptive   # float or "adaptive" (default); NOT algorithm.lam
    +algorithm.compaction_gae.cross_segment=paper   # "paper" (default) | "none" | "stitched"
    +algorithm.compaction_gae.lam_critic=1.0        # lambda of the returns; null: same as lam
    +algorithm.compaction_gae.adaptive_alpha=1.5
    +algorithm.compaction_gae.adaptive_length=rollout   # or "segment"
    +algorithm.compaction_gae.whiten=false   # true: batch-whiten advantages like verl's "gae"
    +algorithm.compaction_gae.rollout_id_key=rollout_id # non_tensor_batch key naming each row's rollout
    +algorithm.compaction_gae.group_by_uid=true  # without that key, rows sharing `uid` are one rollout
                                                  # (right only with rollout.n=1, the paper's group size)
    actor_rollout_ref.actor.policy_loss.loss_mode=compaction

One compacted rollout is several rows (segments) of the batch, in chronological batch order unless
`non_tensor_batch["segment_index"]` gives each row's position in its rollout.

verl's generic `compute_advantage` (verl/trainer/ppo/ray_trainer.py) passes registered estimators the
rewards, the mask, `index` (the uid) and the config, but not the critic's values. Either call
`compute_advantage(data, config)` of this module in your trainer, or call `patch_compute_advantage()`
once (it wraps verl's function so that `compaction_gae` gets the values). The policy loss needs nothing
extra: verl calls it with exactly the signature below.
"""
from __future__ import annotations

import importlib
import inspect
import sys

import torch

from ...ops import ppo_policy_loss
from ...ops._mask import bool_mask_and_count
from ...ops._validate import trusted_layout
from .._common import cfg_get, denominator_from, masked_whiten
from ..padded import as_bool_mask, flat, row_table, segment_gae_padded
from ._options import ADV_ESTIMATOR, POLICY_LOSS, gae_options

def compute_compaction_gae(token_level_rewards, response_mask, values=None, index=None, config=None, *,
                           rollout_ids=None, segment_index=None, **_unused):
    """Advantage estimator `compaction_gae`: `segment_gae` over verl's padded batch.

    Args:
        token_level_rewards: [B, L] float (the rollout reward on the last token of each segment row).
        response_mask: [B, L] 0/1, 1 on policy-generated tokens (tool observations are 0 and skipped).
        values: [B, L] float critic values (required; see the module docstring).
        index: [B] verl's uid per row; the rollout ids when `group_by_uid` and no `rollout_ids`.
        config: verl's `algorithm` config (see the module docstring for its keys).
        rollout_ids, segment_index: [B] per-row rollout ids and chronological positions (packed_layout).
        Other keyword arguments verl passes to every estimator (e.g. reward_baselines) are ignored.

    Returns:
        (advantages [B, L], returns [B, L]) float32, 0 where response_mask is 0.
    """
    if values is None:
        raise ValueError("compaction_gae needs the critic's values: verl's generic compute_advantage does not pass "
                         "them. V1 trainer (trainer.use_v1=true): set trainer.v1.trainer_mode=compaction_sync. "
                         "Legacy trainer: call compactionrl_fast.integrations.verl.compute_advantage(data, config) "
                         "or patch_compute_advantage() (and set critic.enable=True)")
    kw, flags = gae_options(config)
    if rollout_ids is None and flags["group_by_uid"]:
        rollout_ids = index
    mask = as_bool_mask("response_mask", response_mask)
    adv, ret = segment_gae_padded(token_level_rewards, values, mask, rollout_ids, segment_index=segment_index, **kw)
    if flags["whiten"]:
        adv = masked_whiten(adv, mask)
    return adv, ret


def compute_advantage(data, config=None):
    """Fill `data.batch["advantages"]` and `["returns"]` of a verl DataProto with `compaction_gae`.

    Reads `token_level_rewards`, `values`, `response_mask` from `data.batch` and the rollout ids from
    `data.non_tensor_batch[rollout_id_key]` (else `uid` when `group_by_uid`), the chronological positions
    from `data.non_tensor_batch["segment_index"]` when present. Returns `data`.
    """
    _, flags = gae_options(config)
    nt = getattr(data, "non_tensor_batch", None) or {}
    ids = nt.get(flags["rollout_id_key"])
    if ids is None and flags["group_by_uid"]:
        ids = nt.get("uid")
    adv, ret = compute_compaction_gae(data.batch["token_level_rewards"], data.batch["response_mask"],
                                      values=data.batch["values"], config=config, rollout_ids=ids,
                                      segment_index=nt.get("segment_index"))
    data.batch["advantages"] = adv
    data.batch["returns"] = ret
    return data


def _loss_reduction(loss_agg_mode, mask, gbi, loss_scale_factor, count=None):
    """(reduction, denominator, scale) of `ppo_policy_loss` that reproduce verl's `agg_loss` (core_algos.py):
    every verl mode is a token-mean, a segment-mean (one segment per row) or a sum, times a constant.
    `count`: the mask's True values when known (the op need not count them again)."""
    dp = int(gbi.get("dp_size", 1) or 1)
    tokens, seqs = gbi.get("batch_num_tokens"), gbi.get("global_batch_size")
    needed = {"token-mean": ("batch_num_tokens", tokens)}.get(loss_agg_mode, ("global_batch_size", seqs))
    if dp > 1 and loss_agg_mode != "token-sum" and needed[1] is None:  # as verl's agg_loss
        raise ValueError(f"global_batch_info[{needed[0]!r}] is required with dp_size > 1 ({loss_agg_mode})")
    if loss_agg_mode == "token-mean":
        return "token-mean", denominator_from(tokens if tokens is not None else count, dp), 1.0
    if loss_agg_mode == "token-sum":
        return "sum", None, float(dp)
    if loss_agg_mode == "seq-mean-token-mean":
        return "segment-mean", denominator_from(seqs, dp), 1.0
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        # sum over rows of row sums / rows = the token sum / rows: a token-mean with the row count
        rows = denominator_from(seqs, dp)
        if rows is None:
            rows = float(int((mask.sum(-1) > 0).sum()))
        norm = 1.0
        if loss_agg_mode.endswith("-norm"):
            norm = float(loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])
        return "token-mean", rows, 1.0 / norm
    raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not supported by the compaction policy loss")


def compute_policy_loss_compaction(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                   config=None, rollout_is_weights=None):
    """Policy loss `compaction`: verl's PolicyLossFn signature, computed by `ppo_policy_loss`.

    Same math and reductions as verl's "vanilla" loss: clip range from `actor.clip_ratio_low/high`
    (else `clip_ratio`), dual clip `actor.clip_ratio_c` (verl always applies it), every `loss_agg_mode`
    with `config.global_batch_info` (dp_size, batch_num_tokens, global_batch_size) for exact gradient
    accumulation. One pass over the trainable tokens; no [B, L] loss matrix.

    Args:
        old_log_prob, log_prob, advantages: [B, L] float; `log_prob` receives the gradient.
        response_mask: [B, L] 0/1. loss_agg_mode: verl's mode. config: verl's ActorConfig (or a dict).
        rollout_is_weights: [B, L] rollout-correction weights, multiplied into each token's loss.

    Returns:
        (loss [] float32, metrics dict of floats: actor/pg_clipfrac, actor/ppo_kl (mean of old - new log-prob,
        as verl), actor/pg_clipfrac_lower, actor/approx_kl ((ratio-1) - log ratio), actor/ratio_max).
    """
    clip = cfg_get(config, "clip_ratio", 0.2)
    clip_low = cfg_get(config, "clip_ratio_low", None)
    clip_high = cfg_get(config, "clip_ratio_high", None)
    dual = cfg_get(config, "clip_ratio_c", 3.0)
    gbi = cfg_get(config, "global_batch_info", None) or {}
    mask, count = bool_mask_and_count("response_mask", response_mask)
    reduction, denom, scale = _loss_reduction(loss_agg_mode, mask, gbi, cfg_get(config, "loss_scale_factor", None),
                                              count)
    B, L = mask.shape
    adv = flat("advantages", advantages, B, L)  # the rows read in place: one segment per row
    if rollout_is_weights is not None:
        # l(A) is positively homogeneous in A (max/min of -r*A, -clip(r)*A, -c*A), so l(w*A) = w*l(A), w >= 0
        adv = adv * flat("rollout_is_weights", rollout_is_weights, B, L).detach()
    logp, old = flat("log_prob", log_prob, B, L), flat("old_log_prob", old_log_prob, B, L)
    m_flat = mask.reshape(B * L)
    rows = row_table(B, L, device=mask.device).rows if reduction == "segment-mean" else None
    with trusted_layout():
        loss, m = ppo_policy_loss(logp, old, adv, m_flat, cu_seqlens=rows,
                                  clip_low=float(clip if clip_low is None else clip_low),
                                  clip_high=float(clip if clip_high is None else clip_high),
                                  dual_clip=float(dual), reduction=reduction, denominator=denom)
    if scale != 1.0:
        loss = loss * scale
    # verl's metrics are Python floats: one host read for all of them
    clipfrac, log_ratio, lower, approx_kl, ratio_max = torch.stack(
        [m["clip_fraction"], m["log_ratio"], m["dual_clip_fraction"], m["approx_kl"], m["ratio_max"]]).tolist()
    metrics = {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": 0.0 - log_ratio, "actor/pg_clipfrac_lower": lower,
               "actor/approx_kl": approx_kl, "actor/ratio_max": ratio_max}
    return loss, metrics


# verl's V1 trainer hands compute_advantage rows whose session and output index are gone (only `uid`
# remains; they are in the batch keys) and whose rewards verl copied onto every output of a session
_V1_MODULES = ("verl.trainer.ppo.v1.utils",)
V1_REFUSAL = ("compaction_gae on verl's V1 trainer (trainer.use_v1=true): its advantage step passes only `uid`, "
              "so the rollout.n sessions of a prompt would be chained into one rollout and verl's reward copies "
              "counted once per output; use the trainer mode instead: trainer.v1.trainer_mode=compaction_sync "
              "(docs/verl.md)")

# modules that bind verl's compute_advantage by name (verl 0.9)
_TRAINER_MODULES = ("verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.utils",
                    "verl.experimental.separation.ray_trainer")


def patch_compute_advantage(*modules):
    """Wrap `compute_advantage` in verl's trainer modules so that `compaction_gae` receives the values.

    `modules`: module objects or names; default: those of verl 0.9 that bind the function (imported if
    needed; the ones that do not import are skipped). Other estimators go to verl's function unchanged.
    On verl's V1 path (`verl.trainer.ppo.v1.utils`) the wrapped function raises a ValueError that points to
    the trainer mode `compaction_sync`: the rows it receives have lost their session and output index.
    Returns the list of patched modules.
    """
    patched = []
    for mod in modules or _TRAINER_MODULES:
        if isinstance(mod, str):
            try:
                mod = sys.modules.get(mod) or importlib.import_module(mod)
            except ImportError:
                continue
        original = getattr(mod, "compute_advantage", None)
        if original is None or getattr(original, "_compaction_wrapped", False):
            continue

        def wrapped(data, adv_estimator, *args, _original=original, _v1=getattr(mod, "__name__", None) in _V1_MODULES,
                    **kwargs):
            if getattr(adv_estimator, "value", adv_estimator) == ADV_ESTIMATOR:
                if _v1:
                    raise ValueError(V1_REFUSAL)
                bound = inspect.signature(_original).bind(data, adv_estimator, *args, **kwargs)
                return compute_advantage(data, bound.arguments.get("config"))
            return _original(data, adv_estimator, *args, **kwargs)

        wrapped._compaction_wrapped = True
        mod.compute_advantage = wrapped
        patched.append(mod)
    return patched


def register():
    """Register `compaction_gae` and `compaction` with verl's registries; False when verl is not importable."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        return False
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ADV_ESTIMATOR) is not compute_compaction_gae:
        core_algos.register_adv_est(ADV_ESTIMATOR)(compute_compaction_gae)
    core_algos.register_policy_loss(POLICY_LOSS)(compute_policy_loss_compaction)
    return True


REGISTERED = register()
