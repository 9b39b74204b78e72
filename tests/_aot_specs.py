"""What tests/test_aot.py compiles ahead of time for sm_80/sm_90, for every kernels/ module with Triton kernels:
per module, [(kernel name, signature, constexprs[, compile options])] as `triton.compiler.ASTSource` takes
them (tests/_aot.py). The lists of the kernels modules below are kept here; a kernels module may instead
declare its own as `AOT` (a new op's kernels/my_op.py does, docs/adding-an-op.md), which SPECS picks up.

segment_gae (kernels/gae_*.py): every flag combination with int64 offsets, the default path (WRITE,
OWN_CRITIC) with int32 offsets too, and the sizes as the JIT types them for a usual call (a Python int below
2^31 is an i32 argument). The loss mask is passed as the bool tensor itself (*i1: Triton loads its bytes).
"""
from compactionrl_fast.kernels import linear_logprobs as klp
from compactionrl_fast.kernels import segments as kseg
from compactionrl_fast.kernels.gae import BLOCK, CARRY_BLOCK, LOOKBACK_TILE, PARAMS_BLOCK
from compactionrl_fast.kernels import modes
from compactionrl_fast.kernels.modes import (CROSS_NONE, CROSS_PAPER, CROSS_STITCHED, LAM_ADAPTIVE_ROLLOUT,
                                             LAM_ADAPTIVE_SEGMENT, LAM_CONST, LAM_TENSOR, REDUCTION_ROLLOUT_MEAN,
                                             REDUCTION_SEGMENT_MEAN, REDUCTION_SUM, REDUCTION_TOKEN_MEAN)
from compactionrl_fast.kernels import place as kplace
from compactionrl_fast.kernels import ppo_loss as kppo
from compactionrl_fast.kernels.ppo_loss import FINISH_BLOCKS
from compactionrl_fast.kernels.value_loss import NUM_WARPS as VALUE_LOSS_WARPS


def _offsets(idx):
    return {"mask_ptr": "*i1", "cu_ptr": f"*{idx}", "cs_ptr": f"*{idx}"}


def _small(sig):
    """The sizes as int32, as the JIT types a Python int below 2^31."""
    return {k: "i32" if k in ("T", "S", "n_chunks", "chunk", "n_tiles", "n_ws") else v for k, v in sig.items()}


_PARAMS_SIG = dict(start_ptr="*i64", lam_ptr="*fp32", out_ptr="*fp64", S="i64", T="i64",
                   **{f"{k}_{p}": "fp32" for k in ("gamma", "lam", "alpha", "lamc") for p in ("hi", "lo")})
# (index dtype, lambda mode, cross mode, seg_start, zero ws); every cross mode of kernels/modes.py at least once
_PARAMS_CASES = [("i64", LAM_CONST, CROSS_NONE, False, False), ("i64", LAM_ADAPTIVE_ROLLOUT, CROSS_PAPER, False, False),
                 ("i32", LAM_ADAPTIVE_ROLLOUT, CROSS_PAPER, False, False),
                 ("i64", LAM_ADAPTIVE_SEGMENT, CROSS_STITCHED, True, False),
                 ("i64", LAM_TENSOR, CROSS_PAPER, True, False),
                 ("i64", LAM_ADAPTIVE_ROLLOUT, CROSS_PAPER, False, True)]
_PARAMS_CASES += [("i64", LAM_CONST, c, False, False) for c in modes.CROSS_SEGMENT.values()
                  if c not in {case[2] for case in _PARAMS_CASES}]
_PARAMS = [("_gae_params_kernel", dict(_offsets(idx), **_PARAMS_SIG, ws_ptr="*i32" if ws else "*fp64", n_ws="i64"),
            {"LAM_MODE": mode, "CROSS": cross, "NEED_COUNTS": modes.needs_counts(mode, cross), "HAS_START": start,
             "BLOCK": PARAMS_BLOCK, "ZERO_WS": ws})
           for idx, mode, cross, start, ws in _PARAMS_CASES]
_PARAMS.append(("_gae_params_kernel", _small(dict(_offsets("i32"), **_PARAMS_SIG, ws_ptr="*fp64", n_ws="i64")),
                {"LAM_MODE": LAM_ADAPTIVE_ROLLOUT, "CROSS": CROSS_PAPER,
                 "NEED_COUNTS": modes.needs_counts(LAM_ADAPTIVE_ROLLOUT, CROSS_PAPER), "HAS_START": False,
                 "BLOCK": PARAMS_BLOCK, "ZERO_WS": False}))

_CHUNK_SIG = dict(rew_ptr="*fp32", val_ptr="*fp32", start_ptr="*i64", T="i64", S="i64", LOG_S="i32", params_ptr="*fp64",
                  gamma_hi="fp32", gamma_lo="fp32", summary_ptr="*fp64", adv_ptr="*fp32", ret_ptr="*fp32",
                  n_chunks="i64", chunk="i64")
_CHUNK = [("_gae_chunk_kernel", dict(_offsets(idx), **_CHUNK_SIG),
           {"BLOCK": BLOCK, "WRITE": write, "CARRY": carry, "OWN_CRITIC": own, "HAS_START": start,
            "CARRY_BLOCK": CARRY_BLOCK})
          for idx, write, carry, own, start in [
              ("i64", False, False, False, False), ("i64", False, False, True, False),
              ("i64", True, False, False, False), ("i64", True, False, True, False),
              ("i64", True, True, False, False), ("i64", True, True, True, False),
              ("i32", True, False, True, False), ("i32", True, True, True, False),
              ("i64", False, False, True, True), ("i64", True, True, True, True)]]
_CHUNK_CONSTS = dict(BLOCK=BLOCK, OWN_CRITIC=True, HAS_START=False, CARRY_BLOCK=CARRY_BLOCK)
_CHUNK += [("_gae_chunk_kernel", _small(dict(_offsets("i32"), **_CHUNK_SIG)), dict(_CHUNK_CONSTS, WRITE=w, CARRY=w))
           for w in (False, True)]

_LOOKBACK_SIG = dict(rew_ptr="*fp32", val_ptr="*fp32", mask_ptr="*i1", cu_ptr="*i64", start_ptr="*i64", T="i64",
                     S="i64", gl_ptr="*fp64", glc_ptr="*fp64", scale_ptr="*fp64", reset_ptr="*fp64", gamma_hi="fp32",
                     gamma_lo="fp32", ws_ptr="*i32", agg_ptr="*fp64", incl_ptr="*fp64", adv_ptr="*fp32",
                     ret_ptr="*fp32", n_tiles="i64", LOG_S="i32")
_LOOKBACK = [("_gae_lookback_kernel", sig, {"TILE": LOOKBACK_TILE, "BLOCK": BLOCK, "OWN_CRITIC": own,
                                            "HAS_START": start, "INCL_EVERY": 1})
             for sig, own, start in [(_LOOKBACK_SIG, True, False), (_LOOKBACK_SIG, False, False),
                                     (_LOOKBACK_SIG, True, True), (_small(dict(_LOOKBACK_SIG, cu_ptr="*i32")), True, False)]]


# ppo_loss, value_loss: every feature-flag combination that matters, both index dtypes.
def _ppo_sig(idx):
    return {"logp": "*fp32", "old": "*fp32", "adv": "*fp32", "roll": "*fp32", "mask": "*i1", "cu": f"*{idx}",
            "scale": "*fp64", "grad": "*fp32", "part": "*fp64", "ticket": "*i32", "loss_out": "*fp32",
            "metrics_out": "*fp32", "T": "i32", "S": "i32", "n_iter": "i32",
            **{f"{k}{e}": "fp32" for k in ("ratio_lo", "ratio_hi", "dual_c", "tis_cap") for e in ("", "_e")},
            "HAS_TIS": "constexpr", "PER_SEG": "constexpr", "NEED_GRAD": "constexpr", "BT": "constexpr",
            "FB": "constexpr"}


_PPO = [("ppo_loss_fwd_kernel", _ppo_sig(idx), {"HAS_TIS": tis, "PER_SEG": per_seg, "NEED_GRAD": True,
                                                "BT": kppo.BLOCK, "FB": FINISH_BLOCKS},
         {"num_warps": kppo.NUM_WARPS, "maxnreg": kppo.MAXNREG})
        for idx, tis, per_seg in [("i32", False, False), ("i32", True, True), ("i64", False, True)]]


def _value_loss_sig(idx):
    return {"v": "*fp32", "old": "*fp32", "ret": "*fp32", "mask": "*i1", "cu": f"*{idx}", "scale": "*fp64",
            "grad": "*fp32", "part": "*fp64", "ticket": "*i32", "loss_out": "*fp32", "metrics_out": "*fp32",
            "T": "i32", "S": "i32", "n_iter": "i32", "eps": "fp32", "eps_e": "fp32", "USE_CLIP": "constexpr",
            "PER_SEG": "constexpr", "NEED_GRAD": "constexpr", "BT": "constexpr", "FB": "constexpr"}


_VALUE_LOSS = [("value_loss_fwd_kernel", _value_loss_sig(idx),
                {"USE_CLIP": clip, "PER_SEG": per_seg, "NEED_GRAD": True, "BT": 1024, "FB": FINISH_BLOCKS},
                {"num_warps": VALUE_LOSS_WARPS, "maxnreg": kppo.MAXNREG})
               for idx, clip, per_seg in [("i32", True, False), ("i32", False, True), ("i64", True, True)]]

# value_head: forward in bf16 and fp32, backward in every hidden dtype.
_VALUE_HEAD = [
    ("value_head_fwd_kernel",
     {"h": f"*{dt}", "w": "*fp32", "b": "*fp32", "out": "*fp32", "T": "i32", "H": "i32", "stride_t": "i64",
      "HAS_BIAS": "constexpr", "BT": "constexpr", "BH": "constexpr"},
     {"HAS_BIAS": True, "BT": 32, "BH": 128})
    for dt in ("bf16", "fp32")
] + [
    ("value_head_bwd_kernel",
     {"h": f"*{dt}", "w": "*fp32", "g": "*fp32", "dh": f"*{dt}", "dw_part": "*fp32", "T": "i32", "H": "i32",
      "stride_t": "i64", "n_blocks": "i32", "NEED_DH": "constexpr", "NEED_DW": "constexpr", "BT": "constexpr",
      "BH": "constexpr"},
     {"NEED_DH": True, "NEED_DW": True, "BT": 32, "BH": 128})
    for dt in ("bf16", "fp16", "fp32")
]


# linear_logprobs: both kernels, fp32 and bf16 logits, with and without the entropy, at the launchers' block
# shapes for an LM vocabulary (one row per program) and a small one.
def _linear_logprobs_sig(kernel, x_dtype):
    sig = {}
    for name in kernel.arg_names:
        if name in ("BT", "BV", "ENTROPY"):
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = {"x_ptr": f"*{x_dtype}", "y_ptr": "*i64"}.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name == "inv_t" else "i32"
    return sig


_LINEAR_LOGPROBS = [
    (name, _linear_logprobs_sig(getattr(klp, name), dt), {"BT": bt, "BV": bv, "ENTROPY": ent})
    for name in ("linear_logprobs_stats_kernel", "linear_logprobs_dlogits_kernel")
    for dt in ("fp32", "bf16")
    for ent in (False, True)
    for bt, bv in (klp.tile_shape(151936), klp.tile_shape(300))
]

# segments: the counts with both index dtypes; the weights in each reduction and denominator kind.
_SEGMENTS = [("_segment_counts_kernel", {"mask_ptr": "*u8", "cu_ptr": f"*{idx}", "counts_ptr": "*i64", "T": "i64"},
              {"BLOCK": kseg.BLOCK}) for idx in ("i32", "i64")]
_WEIGHTS_SIG = dict(counts_ptr="*i64", cs_ptr="*i64", den_ptr="*fp64", prefix_ptr="*fp64", out_ptr="*fp64", S="i64",
                    R="i64", LOG_R="i32", den_hi="fp32", den_lo="fp32")
_SEGMENTS += [("_segment_weights_kernel", _WEIGHTS_SIG,
               {"REDUCTION": red, "HAS_CS": cs, "DEN": den, "BLOCK": kseg.WEIGHTS_BLOCK})
              for red, cs, den in [(REDUCTION_TOKEN_MEAN, False, 0), (REDUCTION_SEGMENT_MEAN, False, 1),
                                   (REDUCTION_ROLLOUT_MEAN, True, 2), (REDUCTION_ROLLOUT_MEAN, True, 0),
                                   (REDUCTION_SUM, False, 0)]]

# place_final_rewards (kernels/place.py): both modes and index dtypes, sizes as i64 and as the JIT types them.
_PLACE_SIG = dict(rr_ptr="*fp32", mask_ptr="*i1", cu_ptr="*i64", cs_ptr="*i64", out_ptr="*fp32", T="i64", S="i64")
_PLACE = [("_zero_kernel", {"out_ptr": "*fp32", "T": T}, {"BLOCK": kplace.ZERO_BLOCK}, {"num_warps": kplace.NUM_WARPS})
          for T in ("i32", "i64")]
_PLACE += [("_place_kernel", dict(_PLACE_SIG, cu_ptr=f"*{idx}", cs_ptr=f"*{idx}", T=size, S=size),
            {"STITCHED": stitched, "BLOCK": kplace.BLOCK}, {"num_warps": kplace.NUM_WARPS})
           for idx, size, stitched in [("i64", "i64", False), ("i64", "i64", True), ("i32", "i32", False),
                                       ("i32", "i32", True), ("i64", "i32", False)]]

SPECS = {"gae_params": _PARAMS, "gae_chunk": _CHUNK, "gae_lookback": _LOOKBACK, "ppo_loss": _PPO,
         "value_loss": _VALUE_LOSS, "value_head": _VALUE_HEAD, "linear_logprobs": _LINEAR_LOGPROBS,
         "segments": _SEGMENTS, "place": _PLACE}


def _declared():
    """{module: AOT} of the kernels modules that declare their own list."""
    import importlib
    import pkgutil

    import compactionrl_fast.kernels as pkg

    mods = (importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)
            if not m.name.startswith("_"))
    return {m.__name__.rsplit(".", 1)[-1]: list(m.AOT) for m in mods if hasattr(m, "AOT")}


SPECS.update(_declared())
