"""Property test of the public ops over random valid and invalid inputs, each case in a worker subprocess.

Cases (one per seed, reproducible): random packed layouts (segments, empty ones, rollouts, int32/int64
offsets), input dtypes, non-contiguous strides, NaN/Inf at masked and at trainable positions, extreme
values (log-ratios past float32's exp, tiny temperatures, large values), random backends; about a quarter
are made invalid by one mutation (bad offsets, dtypes, shapes, scalars). Properties:
  - no signal, no hang (the worker runs cases in order and says which one it started: a crash or a
    timeout names that seed);
  - invalid input: a ValueError/TypeError whose message names the argument;
  - valid input: no exception, outputs and gradients equal to the float64 reference (cast to float32:
    a NaN there must be NaN here, an inf the same inf, a finite value finite and close).

`pytest tests/test_fuzz.py` runs a fixed, CI-sized set of seeds. For a longer run:
    python -m tests.test_fuzz --minutes 10 [--seed N] [--ops ppo_policy_loss,value_loss]
prints cases tried, clear errors, crashes, hangs and silent mismatches (with the seeds to replay:
`python -m tests.test_fuzz --replay SEED`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("segment_gae", "place_final_rewards", "ppo_policy_loss", "value_loss", "value_head", "value_head_loss",
       "linear_logprobs", "global_token_count")
# seconds on a 2-core machine with the Triton interpreter (in one worker process); and seeds the yardstick once
# got wrong (7940: a float16 gradient below the smallest normal; 11010: bf16 logits at temperature 1e-30; 23454:
# bf16 logits whose usual composition rounded luckily)
CI_SEEDS = [*range(160), 7940, 11010, 23454]
CASE_TIMEOUT_S = 120  # a case (several thousand tokens, interpreter included) takes well under this


# ---------------------------------------------------------------- case generation (worker side)


def _layout(rng, torch, T):
    """(cu_seqlens [S+1], cu_segments [R+1] or None, loss_mask [T]) of a random packing of T tokens."""
    S = rng.randint(1, 6)
    cuts = sorted(rng.randint(0, T) for _ in range(S - 1))
    cu = [0] + cuts + [T]
    n_roll = rng.randint(1, S)
    rcuts = sorted(rng.sample(range(1, S), n_roll - 1)) if S > 1 else []
    cs = [0] + rcuts + [S]
    p = rng.choice([0.0, 0.3, 0.8, 1.0, 0.8])
    mask = torch.rand(T, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < p
    idx = rng.choice([torch.int32, torch.int64])
    return torch.tensor(cu, dtype=idx), (torch.tensor(cs, dtype=idx) if rng.random() < 0.7 else None), mask


def _strided(torch, t, rng):
    """t itself, or an equal non-contiguous view (every other element of a twice-as-long buffer)."""
    if rng.random() < 0.25 and t.dim() >= 1 and t.numel() > 1:
        buf = torch.empty((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype)
        buf[::2] = t
        return buf[::2]
    return t


def _floats(torch, rng, T, mask, scale=1.0, offset=0.0, extremes=(), nan_trainable=False):
    """float64 [T]: random values; inf/NaN on some masked positions; optional extreme values and a NaN on
    trainable positions."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(T, generator=g, dtype=torch.float64) * scale + offset
    off = (~mask).nonzero().flatten().tolist()
    for p in rng.sample(off, min(len(off), rng.randint(0, 3))):
        x[p] = rng.choice([float("nan"), float("inf"), -float("inf"), 1e38])
    on = mask.nonzero().flatten().tolist()
    if extremes and on:
        for p in rng.sample(on, min(len(on), rng.randint(1, 3))):
            x[p] = rng.choice(extremes)
    if nan_trainable and on:
        x[rng.choice(on)] = float("nan")
    return x


def make_case(seed, ops=OPS):
    """The case of `seed`: (op, kwargs for the public op, backend, expected error arg name or None, notes)."""
    import torch

    rng = random.Random(seed)
    op = rng.choice(list(ops))
    big = rng.random() < 0.04
    T = rng.randint(17000, 20000) if big else rng.choice([0, 1, 2, 3, 7, 16, 33, 100])
    cu, cs, mask = _layout(rng, torch, T)
    from compactionrl_fast.kernels import modes
    from compactionrl_fast.ops._dispatch import TABLE

    # each op's CPU backends from the dispatch table (value_head_loss: the head's)
    row = TABLE["value_head" if op == "value_head_loss" else op] if op != "global_token_count" else None
    backends = list(row["cpu"]) if row else [None]
    backend = rng.choice(backends)
    if big and backend == "triton" and op in ("segment_gae", "linear_logprobs", "value_head"):
        backend = "torch-tuned" if op == "linear_logprobs" else "cpp"  # the interpreter: too slow
    dtype = torch.float32 if backend == "triton" else rng.choice([torch.float32, torch.float32, torch.float64,
                                                                   torch.bfloat16, torch.float16])
    extreme = rng.random() < 0.3
    nan_on = rng.random() < 0.08
    f64x = (1e300, -1e300) if extreme and dtype == torch.float64 else ()  # finite in float64 only
    kw, notes = {}, []

    if op in ("ppo_policy_loss", "value_loss"):
        red = rng.choice(["token-mean", "segment-mean", "rollout-mean", "sum"])
        kw.update(loss_mask=mask, reduction=red)
        if red != "token-mean" or rng.random() < 0.6:
            kw.update(cu_seqlens=cu, cu_segments=cs)
        if red != "sum" and rng.random() < 0.3:
            kw["denominator"] = rng.choice([0, 1, 7.5, float(T + 3)])
    if op == "ppo_policy_loss":
        old = _floats(torch, rng, T, mask, 0.8, -2.0)
        ext = (100.0, -100.0, 80.0, 600.0, -1e4) if extreme else ()  # exp stays finite in float64
        lp = old + _floats(torch, rng, T, mask, 0.6, 0.0, ext, nan_on)
        if f64x:  # old log-probs of +-1e300 under ordinary log-probs
            old = old + _floats(torch, rng, T, mask, 0.0, 0.0, f64x)
        kw.update(logprobs=lp, old_logprobs=old, advantages=_floats(torch, rng, T, mask, 1.0, 0.0,
                                                                      (0.0, 0.0, 1e6) + f64x if extreme else ()))
        if rng.random() < 0.5:
            kw["rollout_logprobs"] = old + _floats(torch, rng, T, mask, 0.3, 0.0, (95.0,) if extreme else ())
            if rng.random() < 0.5:
                kw["tis_cap"] = rng.choice([0.5, 2.0, 1e30])
        kw.update(clip_low=rng.choice([0.0, 0.2, 0.9]), clip_high=rng.choice([0.2, 0.28, 5.0]),
                  dual_clip=rng.choice([None, 3.0, 1.0001]))
        grad_of = "logprobs"
    elif op == "value_loss":
        ret = _floats(torch, rng, T, mask, 1.0, rng.choice([0.0, 100.0]), (1e15, -1e15) + f64x if extreme else ())
        old = ret + _floats(torch, rng, T, mask, 0.5, 0.0, (), nan_on)
        kw.update(values=old + _floats(torch, rng, T, mask, 0.4, 0.0, f64x), old_values=old, returns=ret,
                  clip=rng.choice([None, 0.0, 0.2, 1e30]))
        grad_of = "values"
    elif op in ("value_head", "value_head_loss"):
        H = rng.choice([1, 5, 64, 130])
        if big:
            H = 8
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
        if op == "value_head_loss":
            for p in rng.sample((~mask).nonzero().flatten().tolist(), min(int((~mask).sum()), 2)):
                hidden[p, rng.randrange(H)] = rng.choice([float("nan"), float("inf")])
        if extreme:
            hidden *= rng.choice([1e-20, 1e10])
        hd = dtype if dtype != torch.float64 else torch.float32
        kw.update(hidden=hidden.to(hd), weight=torch.randn(H, generator=g).to(rng.choice([hd, torch.float32])),
                  bias=rng.choice([None, torch.randn((), generator=g)]))
        if op == "value_head_loss" and nan_on:  # every value NaN or inf: masked rows' gradients stay 0
            kw["weight"][rng.randrange(H)] = rng.choice([float("nan"), -float("inf")])
        if op == "value_head_loss":
            ret = _floats(torch, rng, T, mask, 1.0)
            kw.update(old_values=ret + _floats(torch, rng, T, mask, 0.3), returns=ret, loss_mask=mask,
                      clip=rng.choice([None, 0.2]), reduction=rng.choice(["token-mean", "segment-mean"]),
                      cu_seqlens=cu, cu_segments=cs)
        grad_of = "hidden"
    elif op == "linear_logprobs":
        T = min(T, 300)
        H, V = rng.choice([1, 8, 33]), rng.choice([1, 5, 300, 2100])
        g = torch.Generator().manual_seed(seed)
        hd = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        hidden = (torch.randn(T, H, generator=g) * rng.choice([1.0, 5.0])).to(hd)
        kw.update(hidden=hidden, weight=torch.randn(V, H, generator=g).to(hd),
                  targets=torch.randint(0, V, (T,), generator=g).to(rng.choice([torch.int64, torch.int32])),
                  bias=rng.choice([None, torch.randn(V, generator=g).to(hd)]),
                  temperature=rng.choice([1.0, 0.7, 1e-30 if extreme else 2.0]),
                  chunk_size=rng.choice([None, 1, 7, 64]), return_entropy=rng.random() < 0.6)
        grad_of = "hidden"
    elif op == "segment_gae":
        kw.update(rewards=_floats(torch, rng, T, mask, 1.0), values=_floats(torch, rng, T, mask, 0.5, 0.0,
                                                                           (1e6,) if extreme else (), nan_on),
                  loss_mask=mask, cu_seqlens=cu, cu_segments=cs, gamma=rng.choice([1.0, 0.99, 0.0]),
                  lam=rng.choice(["adaptive", 0.95, 1.0, 0.0]),
                  cross_segment=rng.choice(list(modes.CROSS_SEGMENT)),
                  lam_critic=rng.choice([1.0, None, 0.9]), adaptive_length=rng.choice(["rollout", "segment"]))
        grad_of = None
    elif op == "place_final_rewards":
        R = (cs.numel() - 1) if cs is not None else (cu.numel() - 1)
        kw.update(rollout_rewards=torch.randn(R, dtype=torch.float64), loss_mask=mask, cu_seqlens=cu,
                  cu_segments=cs, mode=rng.choice(list(modes.REWARD_PLACEMENT)))
        grad_of = None
    else:
        kw.update(loss_mask=mask)
        grad_of = None

    # float inputs in the case's dtype, some non-contiguous
    for k, v in list(kw.items()):
        if isinstance(v, torch.Tensor) and v.dtype == torch.float64 and k not in ("rollout_rewards",) and \
                op not in ("value_head", "value_head_loss", "linear_logprobs"):
            kw[k] = _strided(torch, v.to(dtype), rng)
        elif isinstance(v, torch.Tensor) and k in ("old_values", "returns"):
            kw[k] = v.float()
    expect = None
    if rng.random() < 0.25:
        expect = _mutate(rng, torch, op, kw)
        notes.append(f"invalid: {expect[1]}")
    if backend is not None:
        kw["backend"] = backend
    return op, kw, grad_of, expect, notes


def _mutate(rng, torch, op, kw):
    """Make the case invalid in one way; returns (argument name the error must name, description)."""
    tensors = [k for k, v in kw.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and k != "loss_mask"]
    choices = []
    if kw.get("cu_seqlens") is not None:
        cu = kw["cu_seqlens"]
        T = kw["loss_mask"].numel()
        choices += [("cu_seqlens", "past T", lambda: cu.clone().index_fill_(0, torch.tensor([cu.numel() - 1]), T + 5)),
                    ("cu_seqlens", "2^40", lambda: torch.tensor([0, 1 << 40] + [T], dtype=torch.int64)),
                    ("cu_seqlens", "decreasing", lambda: torch.tensor([0, T + 1, 1, T], dtype=cu.dtype)),
                    ("cu_seqlens", "float", lambda: cu.float()),
                    ("cu_seqlens", "first != 0", lambda: torch.cat([cu[:1] + 1, cu[1:]]))]
    if "loss_mask" in kw:
        m = kw["loss_mask"]
        choices += [("loss_mask", "float mask", lambda: m.float()), ("loss_mask", "2-D mask", lambda: m[None])]
    for k in tensors:
        if kw[k].is_floating_point() and k not in ("rollout_rewards",):
            choices.append((k, "int dtype", (lambda k=k: kw[k].int())))
            if kw[k].numel():
                choices.append((k, "too short", (lambda k=k: kw[k][:-1])))
    scalars = {"reduction": "mean", "clip_low": -0.1, "clip_high": float("nan"), "dual_clip": 0.5, "clip": -1.0,
               "gamma": 1.5, "lam": "auto", "cross_segment": "both", "temperature": 0.0, "chunk_size": 0,
               "mode": "last", "tis_cap": -1.0, "denominator": -1.0, "return_entropy": 1}
    for k, bad in scalars.items():
        if k in kw or (k == "gamma" and op == "segment_gae") or (k == "temperature" and op == "linear_logprobs"):
            choices.append((k, f"{k}={bad!r}", (lambda bad=bad: bad)))
    if op == "linear_logprobs":
        V = kw["weight"].shape[0]
        if kw["targets"].numel():
            choices.append(("targets", "target = V", lambda: kw["targets"].clone().fill_(V)))
        choices.append(("temperature", "temperature 1e-300", lambda: 1e-300))
    name, desc, fn = rng.choice(choices)
    kw[name] = fn()
    if name == "denominator" and kw.get("reduction") == "sum":
        kw["reduction"] = "token-mean"
    return name, desc


# ---------------------------------------------------------------- running a case and comparing


def _ref(op, kw):
    import torch

    import importlib

    R = importlib.import_module("compactionrl_fast.reference.gae")
    RL = importlib.import_module("compactionrl_fast.reference.linear_logprobs")
    RLo = importlib.import_module("compactionrl_fast.reference.losses")

    k = {a: b for a, b in kw.items() if a != "backend"}
    if op == "ppo_policy_loss":
        return RLo.ppo_policy_loss(**k)
    if op == "value_loss":
        return RLo.value_loss(**k)
    if op == "value_head":
        return RLo.value_head(k["hidden"], k["weight"], k["bias"])
    if op == "value_head_loss":  # a non-trainable token's row is never read (docs/ops.md): zeroed here
        v = RLo.value_head(torch.where(k["loss_mask"][:, None], k.pop("hidden"), 0.0), k.pop("weight"), k.pop("bias"))
        return RLo.value_loss(v, k.pop("old_values"), k.pop("returns"), k.pop("loss_mask"), **k)
    if op == "linear_logprobs":
        k.pop("chunk_size")
        return RL.linear_logprobs(**k)
    if op == "segment_gae":
        return R.segment_gae(**k)
    if op == "place_final_rewards":
        return R.place_final_rewards(**k)
    return int(k["loss_mask"].sum())


def _call(op, kw):
    import inspect

    import compactionrl_fast as crf

    fn = getattr(crf, op)
    if "backend" in kw and "backend" not in inspect.signature(fn).parameters:
        kw = {k: v for k, v in kw.items() if k != "backend"}
    return fn(**kw)


def _flat(out):
    """Outputs as a list of (name, tensor)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [("out", out)]
    if isinstance(out, (int, float)):
        return [("out", torch.tensor(float(out)))]
    if isinstance(out, dict):
        return [(k, v) for k, v in out.items()]
    res = []
    for i, o in enumerate(out):
        res += [(f"{i}.{n}", t) for n, t in _flat(o)]
    return res


def _compare(name, got, want, rtol, atol):
    """None, or why got (float32 or lower) is not want (float64) cast to float32."""
    import torch

    # both rounded to the output's precision (float32, or a gradient's bf16/fp16/float64): an overflow there is inf
    low = got.dtype if got.dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32
    got = got.detach().cpu().to(low).double().reshape(-1)
    want = want.detach().cpu().to(low).double().reshape(-1)
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    wn, gn = want.isnan(), got.isnan()
    if (wn & ~gn).any():
        i = int((wn & ~gn).nonzero()[0])
        return f"{name}[{i}]: reference NaN, got {got[i].item()!r} (NaN hidden)"
    if (gn & ~wn).any():
        i = int((gn & ~wn).nonzero()[0])
        return f"{name}[{i}]: got NaN, reference {want[i].item()!r}"
    wi = want.isinf() & ~wn
    if (wi & (got != want)).any():
        i = int((wi & (got != want)).nonzero()[0])
        return f"{name}[{i}]: reference {want[i].item()!r}, got {got[i].item()!r}"
    fin = ~(wn | wi)
    if (fin & ~torch.isfinite(got)).any():
        i = int((fin & ~torch.isfinite(got)).nonzero()[0])
        return f"{name}[{i}]: reference finite {want[i].item()!r}, got {got[i].item()!r}"
    bad = fin & ((got - want).abs() > atol + rtol * want.abs())
    if bad.any():
        i = int(bad.nonzero()[0])
        return f"{name}[{i}]: {got[i].item()!r} vs reference {want[i].item()!r} (atol {atol:.3g}, rtol {rtol:.3g})"
    return None


def _scale(op, kw):
    """A size for absolute tolerances: sum_t w_t |l_t| for the losses, sum of |inputs| for GAE."""
    import torch

    import importlib

    RLo = importlib.import_module("compactionrl_fast.reference.losses")
    try:
        k = {a: b for a, b in kw.items() if a != "backend"}
        m = k["loss_mask"]
        if op == "ppo_policy_loss":
            l_tok = RLo.ppo_token_losses(RLo._masked(k["logprobs"], m), RLo._masked(k["old_logprobs"], m),
                                         RLo._masked(k["advantages"], m), clip_low=k["clip_low"],
                                         clip_high=k["clip_high"], dual_clip=k["dual_clip"],
                                         rollout_logprobs=RLo._masked(k.get("rollout_logprobs"), m),
                                         tis_cap=k.get("tis_cap"))[0]
        elif op == "value_loss":
            l_tok = RLo.value_token_losses(RLo._masked(k["values"], m), RLo._masked(k["old_values"], m),
                                           RLo._masked(k["returns"], m), clip=k["clip"])[0]
        else:
            x = sum(RLo._masked(k[n], m).abs() for n in ("rewards", "values") if n in k)
            return float(torch.nan_to_num(torch.as_tensor(x), posinf=0.0).sum()) + 1.0
        w = RLo.token_weights(m, k.get("cu_seqlens"), k.get("cu_segments"), k.get("reduction", "token-mean"),
                              k.get("denominator"))
        return float(torch.nan_to_num((w * l_tok.detach().abs()), nan=0.0, posinf=0.0).sum()) + 1e-30
    except Exception:  # the tolerance only; the comparison itself reports problems
        return 1.0


def _magnitude(kw):
    """The largest finite |value| of the trainable positions of the float [T] inputs."""
    import torch

    m, out = kw.get("loss_mask"), 0.0
    for v in kw.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and m is not None and v.shape == m.shape and m.any():
            x = v.detach()[m].double()
            x = x[torch.isfinite(x)]
            out = max(out, float(x.abs().max()) if x.numel() else 0.0)
    return out


def run_case(seed, ops=OPS):
    """Run one case in this process: returns a dict {seed, op, outcome, detail}."""
    import importlib

    import torch

    op, kw, grad_of, expect, notes = make_case(seed, ops)
    desc = f"{op} backend={kw.get('backend')} " + " ".join(notes)
    res = dict(seed=seed, op=op, desc=desc)
    # autograd leaves
    if grad_of is not None and expect is None and isinstance(kw.get(grad_of), torch.Tensor):
        kw[grad_of] = kw[grad_of].detach().clone().requires_grad_()
    try:
        out = _call(op, kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
        if expect is None:
            return dict(res, outcome="rejected_valid", detail=f"{type(e).__name__}: {msg[:300]}")
        if expect[0] not in msg:
            return dict(res, outcome="unclear_error", detail=f"expected the message to name {expect[0]}: "
                                                             f"{type(e).__name__}: {msg[:300]}")
        return dict(res, outcome="clear_error", detail=f"{type(e).__name__}: {msg[:120]}")
    except Exception as e:  # noqa: BLE001 - any other exception is a finding
        return dict(res, outcome="unclear_error", detail=f"{type(e).__name__}: {str(e)[:300]}")
    if expect is not None:
        return dict(res, outcome="accepted_invalid", detail=f"no error for {expect[1]}")
    # the reference on the same inputs, rounded as the ops round them: they compute in float32, but
    # backend="torch" is the float64 reference itself and the cpp losses compute float64 inputs in float64
    r32 = kw.get("backend") != "torch" and not (op in ("ppo_policy_loss", "value_loss") and kw.get("backend") == "cpp")
    rkw = {k: (v.detach().float() if v.dtype == torch.float64 and r32 else v.detach())
           if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    g_leaf = None
    if grad_of is not None:
        g_leaf = rkw[grad_of].double().requires_grad_()
        rkw[grad_of] = g_leaf
    want = _ref(op, rkw)
    problems = []
    got_l, want_l = _flat(out), _flat(want)
    scale = _scale(op, rkw)
    half = op == "linear_logprobs" and kw["hidden"].dtype != torch.float32
    if half:  # bf16/fp16 logits: the yardstick is the usual composition's error in that dtype, or what
        # rounding the logits to that dtype can do (whichever is larger: the composition may round luckily):
        # each logit moves by at most delta = eps * max|logit| / T (one ulp: matmul and bias may round apart),
        # a log-prob by 2 delta, an entropy by 2 log(V) delta, a gradient's softmax by min(2 delta, 2) in l1
        nkw = {k: v for k, v in rkw.items() if k not in ("backend", "chunk_size")}
        naive = _flat(importlib.import_module("compactionrl_fast.reference.linear_logprobs")
                      .naive_linear_logprobs(**dict(nkw, **{grad_of: kw[grad_of].detach()})))
        h64, w64 = kw["hidden"].detach().double(), kw["weight"].detach().double()
        x = h64 @ w64.T + (0.0 if kw.get("bias") is None else kw["bias"].detach().double())
        inv_t = 1.0 / kw.get("temperature", 1.0)
        xmax = float(torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).max()) if x.numel() else 0.0
        delta = torch.finfo(kw["hidden"].dtype).eps * xmax * inv_t
        wmax = float(torch.nan_to_num(w64.abs(), nan=0.0, posinf=0.0).max()) if w64.numel() else 0.0
        round_bound = [2 * delta, 2 * math.log(max(w64.shape[0], 2)) * delta]
    for i, ((n, g), (_, w)) in enumerate(zip(got_l, want_l)):
        metric = n not in ("out", "0.out", "0", "1.out")
        # metrics are float32 sums: absolute error ~ eps32 * the largest input (1e15 next to 100 cancels)
        rtol, atol = (1e-3, 1e-5 + 1e-6 * _magnitude(rkw)) if metric else (2e-4, 2e-5 * scale)
        if op in ("value_head", "value_head_loss", "linear_logprobs"):
            rtol, atol = 1e-3, 1e-4 * (1.0 + float(torch.nan_to_num(w.detach().abs(), posinf=0).max()) if w.numel() else 1.0)
        if op == "segment_gae":
            rtol, atol = 1e-4, 1e-5 * scale
        if half:
            err = float(torch.nan_to_num((naive[i][1].double() - w.detach().double()).abs(), nan=0.0).max()) \
                if w.numel() else 0.0
            rtol, atol = 1e-3, max(3 * err, round_bound[min(i, 1)]) + 1e-3
        p = _compare(n, g, w, rtol, atol)
        if p:
            problems.append(p)
    # gradients of the first output's sum
    if grad_of is not None and not problems:
        g_out = got_l[0][1]
        w_out = want_l[0][1]
        if g_out.requires_grad:  # also for a NaN or inf loss: the gradient's NaNs must sit where the reference's do
            gsum = g_out.float().sum()
            (gg,) = torch.autograd.grad(gsum, kw[grad_of], allow_unused=True)
            (wg,) = torch.autograd.grad(w_out.sum(), g_leaf, allow_unused=True)
            if gg is not None and wg is not None:
                wg32 = wg.double() if gg.dtype == torch.float64 else wg.float().double()
                fi = torch.finfo(gg.dtype)
                lo = fi.eps if gg.dtype != torch.float32 else 2e-4
                amax = float(torch.nan_to_num(wg32.abs(), posinf=0).max()) if wg32.numel() else 0.0
                # a gradient rounded to its dtype is off by up to one step of that dtype, which below the
                # smallest normal (half precision) is a fixed tiny * eps, not eps relative
                atol = 1e-5 * amax + fi.tiny * fi.eps + 1e-30
                if half:  # bf16/fp16 logits (see above): d hidden = (e_y - p) W / T
                    lo = 0.05
                    atol = max(0.2 * amax, min(2 * delta, 2.0) * wmax * inv_t) + 1e-30
                p = _compare(f"d{grad_of}", gg, wg, max(lo, 2e-4), atol)
                if p:
                    problems.append(p)
    if problems:
        return dict(res, outcome="mismatch", detail="; ".join(problems)[:600])
    return dict(res, outcome="ok", detail="")


def worker(seeds, ops):
    """Run the seeds in order, one JSON line before ("start") and after each case."""
    import torch

    torch.set_num_threads(2)
    for s in seeds:
        print(json.dumps({"start": s}), flush=True)
        try:
            r = run_case(s, ops)
        except Exception:  # noqa: BLE001 - a bug of the harness or the reference: report, keep going
            r = dict(seed=s, op="?", desc="", outcome="harness_error", detail=traceback.format_exc()[-600:])
        print(json.dumps(r), flush=True)


# ---------------------------------------------------------------- parent: batches of cases in subprocesses


def run_seeds(seeds, ops=OPS, batch=40, case_timeout=CASE_TIMEOUT_S, deadline=None):
    """Run the seeds in worker subprocesses, `batch` at a time. Returns the list of result dicts, with
    outcome "crash" (the worker died: signal or exit code) or "hang" (the case ran past case_timeout)."""
    env = dict(os.environ, TRITON_INTERPRET="1", COMPACTIONRL_FAST_POISON="1", OMP_NUM_THREADS="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("COMPACTIONRL_FAST_CHECKS", None)
    env.pop("COMPACTIONRL_FAST_BACKEND", None)
    todo, results = list(seeds), []
    while todo and (deadline is None or time.time() < deadline):
        chunk, todo = todo[:batch], todo[batch:]
        p = subprocess.Popen([sys.executable, "-m", "tests.test_fuzz", "--worker", ",".join(map(str, chunk)),
                              "--ops", ",".join(ops)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        done, started = set(), None
        try:
            out, err = p.communicate(timeout=case_timeout * len(chunk) / 4 + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            timed_out = True
        else:
            timed_out = False
        for line in out.splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "start" in d:
                started = d["start"]
            else:
                results.append(d)
                done.add(d["seed"])
        if started is not None and started not in done:
            kind = "hang" if timed_out else "crash"
            results.append(dict(seed=started, op="?", desc="", outcome=kind,
                                detail=f"return code {p.returncode}; stderr: {err[-400:]}"))
            done.add(started)
        # the rest of the chunk, after the case that killed the worker
        rest = [s for s in chunk if s not in done]
        if rest and started is None and (timed_out or p.returncode != 0):
            results.append(dict(seed=rest[0], op="?", desc="", outcome="crash",
                                detail=f"worker failed to start: {err[-600:]}"))
            rest = rest[1:]
        todo = rest + todo
    return results


FINDINGS = ("rejected_valid", "unclear_error", "accepted_invalid", "mismatch", "crash", "hang", "harness_error")


def summary(results):
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    lines = [f"cases tried: {len(results)}", "outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))]
    for r in results:
        if r["outcome"] in FINDINGS:
            lines.append(f"  seed {r['seed']} {r['outcome']}: {r['desc']} -- {r['detail']}")
    return "\n".join(lines)


def test_fuzz_public_ops():
    """A fixed set of seeds (CI-sized): no crash, no hang, clear errors, reference equality."""
    # every seed in one worker process: a worker's start (torch, triton, the package) costs more than all the
    # cases together (a crash or hang still names its seed, and the seeds after it run in a new worker)
    results = run_seeds(CI_SEEDS, batch=len(CI_SEEDS))
    bad = [r for r in results if r["outcome"] in FINDINGS]
    assert len(results) == len(CI_SEEDS), summary(results)
    assert not bad, summary(results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1000, help="first seed (cases are seed, seed+1, ...)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--replay", type=int, help="run one seed in this process and print the result")
    a = ap.parse_args()
    ops = tuple(o for o in a.ops.split(",") if o)
    unknown = set(ops) - set(OPS)
    if unknown:
        ap.error(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    if a.worker is not None:
        worker([int(s) for s in a.worker.split(",") if s], ops)
        return
    if a.replay is not None:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(json.dumps(run_case(a.replay, ops), indent=1))
        return
    deadline = time.time() + 60 * a.minutes
    results, s = [], a.seed
    while time.time() < deadline:
        results += run_seeds(range(s, s + 200), ops, deadline=deadline)
        s += 200
    print(summary(results))


if __name__ == "__main__":
    main()
