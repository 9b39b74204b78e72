"""What tests/test_aot.py compiles ahead of time for the kernels/ modules that do not list it themselves:
per module, [(kernel name, signature, constexprs[, compile options])] as `triton.compiler.ASTSource` takes
them (tests/_aot.py). The other kernels/*.py modules still list theirs in their own `AOT_SPECS`.

segment_gae (kernels/gae_*.py): every flag combination with int64 offsets, the default path (WRITE,
OWN_CRITIC) with int32 offsets too, and the sizes as the JIT types them for a usual call (a Python int below
2^31 is an i32 argument). The loss mask is passed as the bool tensor itself (*i1: Triton loads its bytes).
"""
from compactionrl_fast.kernels.gae import BLOCK, CARRY_BLOCK, LOOKBACK_TILE, PARAMS_BLOCK
from compactionrl_fast.kernels.modes import (CROSS_NONE, CROSS_PAPER, CROSS_STITCHED, LAM_ADAPTIVE_ROLLOUT,
                                             LAM_ADAPTIVE_SEGMENT, LAM_CONST, LAM_TENSOR)


def _offsets(idx):
    return {"mask_ptr": "*i1", "cu_ptr": f"*{idx}", "cs_ptr": f"*{idx}"}


def _small(sig):
    """The sizes as int32, as the JIT types a Python int below 2^31."""
    return {k: "i32" if k in ("T", "S", "n_chunks", "chunk", "n_tiles", "n_ws") else v for k, v in sig.items()}


_PARAMS_SIG = dict(start_ptr="*i64", lam_ptr="*fp32", out_ptr="*fp64", S="i64", T="i64",
                   **{f"{k}_{p}": "fp32" for k in ("gamma", "lam", "alpha", "lamc") for p in ("hi", "lo")})
_PARAMS = [("_gae_params_kernel", dict(_offsets(idx), **_PARAMS_SIG, ws_ptr="*i32" if ws else "*fp64", n_ws="i64"),
            {"LAM_MODE": mode, "CROSS": cross, "NEED_COUNTS": counts, "HAS_START": start, "BLOCK": PARAMS_BLOCK,
             "ZERO_WS": ws})
           for idx, mode, cross, counts, start, ws in [("i64", LAM_CONST, CROSS_NONE, False, False, False),
                                                       ("i64", LAM_ADAPTIVE_ROLLOUT, CROSS_PAPER, True, False, False),
                                                       ("i32", LAM_ADAPTIVE_ROLLOUT, CROSS_PAPER, True, False, False),
                                                       ("i64", LAM_ADAPTIVE_SEGMENT, CROSS_STITCHED, True, True, False),
                                                       ("i64", LAM_TENSOR, CROSS_PAPER, True, True, False),
                                                       ("i64", LAM_ADAPTIVE_ROLLOUT, CROSS_PAPER, True, False, True)]]
_PARAMS.append(("_gae_params_kernel", _small(dict(_offsets("i32"), **_PARAMS_SIG, ws_ptr="*fp64", n_ws="i64")),
                {"LAM_MODE": LAM_ADAPTIVE_ROLLOUT, "CROSS": CROSS_PAPER, "NEED_COUNTS": True, "HAS_START": False,
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

SPECS = {"gae_params": _PARAMS, "gae_chunk": _CHUNK, "gae_lookback": _LOOKBACK}
