"""`linear_logprobs`: log-probs and entropy of the LM head's softmax without [T, V] logits (docs/ops.md).

The tokens are processed in chunks of C rows: the logits `hidden_c @ W.T + b` of a chunk go into one
[C, V] buffer (a BLAS / cuBLAS matmul), then the per-row softmax work on z = logits / temperature runs
on it: in PyTorch ("torch", the CPU default) or in the Triton kernels of kernels/linear_logprobs.py
("triton", the CUDA default). Backward recomputes each chunk's logits, turns them into dL/dz in place
and runs the two gradient matmuls: 4 matmuls in all where the naive composition runs 3, in exchange
for O(C * V) memory. `linear_logprobs_loss` is the fused variant: the caller's (token-separable) loss
is applied inside the forward chunk loop, so the gradients come from the logits still in the buffer
(3 matmuls).

`linear_logprobs` is two custom ops, `compactionrl_fast::linear_logprobs_fwd` (the forward chunk loop)
and `compactionrl_fast::linear_logprobs_bwd` (the backward one), with fake impls and a registered
autograd formula, so torch.compile traces it without a graph break. `linear_logprobs_loss` takes a
Python callable, which a custom op schema cannot carry: it stays a torch.autograd.Function.

Gradients of both outputs with respect to z (p = softmax(z), H = entropy, one-hot of the target e_y):
    d logp / dz = e_y - p            d H / dz = -p * (log p + H)
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from . import _alloc
from ._reduction import resolve_backend
from ._validate import check_float, check_tensor, value_checks

HIDDEN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Logits elements per chunk buffer when chunk_size is None. CPU: 64 MB of fp32 (512 rows at V = 32768;
# with 2 threads, 256 rows took ~1.25x the time of 512 or 1024 on the 2-core dev VM: BLAS efficiency
# of the thin matmuls). CUDA: 512 MB of bf16 (~1760 rows at V = 151936: large enough for cuBLAS, small
# next to the [V, H] fp32 weight-gradient accumulator).
CHUNK_ELEMS = {"cpu": 1 << 24, "cuda": 1 << 28}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# log p below which p is 0 in float32 (exp(-104) flushes): the entropy gradient clamps log p there, so that
# g * log p stays finite where p = 0 (tiny temperatures make log p ~ -1e30, and 0 * inf is NaN)
LOG_P_FLOOR = -1.0e4


def default_chunk_size(T: int, V: int, device: torch.device) -> int:
    """Rows per chunk: the CHUNK_ELEMS budget over V, a multiple of 16 when it can be, at most T."""
    c = max(1, CHUNK_ELEMS.get(device.type, CHUNK_ELEMS["cpu"]) // max(V, 1))
    if c >= 16:
        c -= c % 16
    return max(1, min(c, T))


# ---------------------------------------------------------------- per-chunk pieces


def _logits(h_c, weight, bias, scale, out):
    """out [c, V] (weight dtype) = (h_c @ W.T + b) * scale, the scale on the matmul's alpha/beta."""
    if bias is None:
        return torch.addmm(out, h_c, weight.T, beta=0.0, alpha=scale, out=out)
    return torch.addmm(bias, h_c, weight.T, beta=scale, alpha=scale, out=out)


def _target_index(y, V):
    """(y clamped into [0, V), y in range) [c]: out-of-range targets (unchecked on CUDA) read column 0 and
    are then given logp NaN and no one-hot gradient term, never an out-of-bounds access."""
    ok = (y >= 0) & (y < V)
    return torch.where(ok, y, 0), ok


def _stats_torch(z, y, lse, logp, ent, tmp, rowmax=None, logsum=None):
    """lse, logp (and entropy) of the fp32 logits z [c, V]. With a tmp buffer, leaves z - max in z and
    returns the shift [c] that turns it into log p; without one (no entropy), clobbers z. rowmax, logsum:
    [c] outputs of max_v z and log sum_v exp(z - max) (for a backward that recomputes the logits)."""
    y, ok = _target_index(y, z.shape[1])
    z_y = z.gather(1, y[:, None])[:, 0]
    m = z.amax(1)
    z.sub_(m[:, None])  # d = z - max
    e = z.exp_() if tmp is None else torch.exp(z, out=tmp)
    s = e.sum(1)
    log_s = s.log()
    lse.copy_(m + log_s)
    # logp = (z_y - max) - log s, never z_y - lse (lse rounds at large logits)
    logp.copy_(torch.where(ok, (z_y - m) - log_s, float("nan")))
    if rowmax is not None:
        rowmax.copy_(m)
        logsum.copy_(log_s)
    if ent is not None:  # H = log s - E[d], never lse - E[z] (cancellation when lse is large)
        ent.copy_(log_s - e.mul_(z).sum(1) / s)  # mul + pairwise sum: 10x more precise than a bmm dot
    return log_s


def _dlogits_torch(z, y, shift, ent, g_lp, g_ent, tmp, z_is_exp=False):
    """z [c, V] fp32 with log p = z - shift -> dL/dz in place: g_lp * (e_y - p) - g_ent * p * (log p + H).

    z_is_exp: z holds exp(z - max) = p * exp(shift) instead (left so by `_stats_torch` without tmp).
    """
    y, ok = _target_index(y, z.shape[1])
    if z_is_exp:
        z.mul_((-g_lp * torch.exp(-shift))[:, None])
    elif g_ent is None:
        z.sub_(shift[:, None]).exp_().mul_(-g_lp[:, None])
    else:
        # log p = z - shift >= LOG_P_FLOOR: unchanged where p > 0, keeps g_ent * log p finite where p = 0
        torch.maximum(z, (shift + LOG_P_FLOOR)[:, None], out=z)
        p = torch.sub(z, shift[:, None], out=tmp).exp_()
        # -p * (g_lp + g_ent * (z - shift + H)) = p * (-g_ent * z - (g_lp + g_ent * (H - shift)))
        c = -(g_lp + g_ent * (ent - shift))
        torch.addcmul(c[:, None], z, -g_ent[:, None], out=z).mul_(p)
    z.scatter_add_(1, y[:, None], torch.where(ok, g_lp, 0.0)[:, None])
    return z


class _Chunker:
    """Buffers and the per-chunk steps, for one forward or backward pass."""

    def __init__(self, hidden, weight, bias, inv_t, C, use_triton, need_tmp):
        self.hidden, self.weight, self.bias, self.inv_t, self.use_triton = hidden, weight, bias, inv_t, use_triton
        V, dev = weight.shape[0], weight.device
        self.buf = torch.empty(C, V, dtype=weight.dtype, device=dev)  # matmul output
        # the PyTorch softmax work runs in fp32: a second buffer for bf16/fp16, a third for p
        self.fbuf = None if use_triton or weight.dtype == torch.float32 else torch.empty(C, V, device=dev)
        self.tmp = torch.empty(C, V, device=dev) if need_tmp and not use_triton else None

    def _tmp(self, z):
        return None if self.tmp is None else self.tmp[:z.shape[0]]

    def logits(self, sl):
        """(x, z) of the rows `sl`: x in the matmul dtype, z = x / temperature in fp32 (PyTorch path).

        The temperature is applied in fp32: by the fp32 matmul's alpha (before its one rounding), by the
        copy to fp32 for bf16/fp16 (a bf16 matmul may round before and after alpha), or by the Triton
        kernels after their load (x is then unscaled).
        """
        c = sl.stop - sl.start
        fold = self.fbuf is None and not self.use_triton
        x = _logits(self.hidden[sl], self.weight, self.bias, self.inv_t if fold else 1.0, self.buf[:c])
        if self.use_triton or self.fbuf is None:
            return x, x
        return x, torch.mul(x, self.inv_t, out=self.fbuf[:c])

    def stats(self, sl, y, lse, logp, ent, rowmax=None, logsum=None):
        """Write lse, logp, ent of rows `sl` (and, PyTorch path, rowmax and logsum, see `_stats_torch`).
        Returns the chunk's state (x, z, shift, z_is_exp) for `dlogits`: the Triton kernels leave x as it
        was; the PyTorch path leaves z - max in z, or exp(z - max) when it has no tmp buffer."""
        x, z = self.logits(sl)
        if self.use_triton:
            from ..kernels.linear_logprobs import linear_logprobs_stats
            linear_logprobs_stats(x, y, lse, logp, ent, self.inv_t)
            return x, z, lse, False
        return x, z, _stats_torch(z, y, lse, logp, ent, self._tmp(z), rowmax, logsum), self.tmp is None

    def dlogits(self, sl, y, lse, ent, g_lp, g_ent, state=None, rowmax=None, logsum=None):
        """dL/dz of the rows `sl` in the matmul dtype (a view of the chunk buffer), and the same in fp32
        when the PyTorch path has it (else None). Recomputes the logits unless `state` (from `stats` on
        this chunk) still holds them; the PyTorch path then shifts them by the forward's row max
        `rowmax` and takes log p = (z - max) - logsum, which keeps its digits at large logits (z - lse
        would cancel)."""
        if state is None:
            x, z = self.logits(sl)
            state = (x, z, lse, False)
            if not self.use_triton and rowmax is not None:
                state = (x, z.sub_(rowmax[:, None]), logsum, False)
        x, z, shift, z_is_exp = state
        if self.use_triton:
            from ..kernels.linear_logprobs import linear_logprobs_dlogits
            return linear_logprobs_dlogits(x, y, shift, ent, g_lp, g_ent, self.inv_t), None
        _dlogits_torch(z, y, shift, ent, g_lp, g_ent, self._tmp(z), z_is_exp)
        return (x, z) if x is z else (x.copy_(z), z)


_FP32_OUT_MM = [True]  # whether torch.addmm(..., out_dtype=float32) works for bf16/fp16 CUDA matmuls


class _Grads:
    """Accumulates d hidden, d W, d b chunk by chunk (W and b in fp32 unless they are fp32 already)."""

    def __init__(self, hidden, weight, bias, needs, n_chunks):
        self.hidden, self.weight, self.n_chunks = hidden, weight, n_chunks
        need_h, self.need_w, need_b = needs
        self.dh = _alloc.empty(*hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        dev = weight.device
        self.dw = torch.zeros(weight.shape, device=dev) if self.need_w and n_chunks != 1 else None
        self.db = torch.zeros(bias.shape, device=dev) if need_b else None

    def add(self, sl, d, d32=None):
        """d: [c, V] dL/d(logits before the temperature), rows `sl`, in the matmul dtype; d32: the same in
        fp32 when the caller has it (the PyTorch path for bf16/fp16), else None.

        d W accumulates in fp32 in place (no [V, H] temporary per chunk): addmm_ for fp32, cuBLAS's
        fp32-output bf16/fp16 matmul on CUDA, else the fp32 d32 (or an fp32 copy of d, [c, V]) with h_c
        upcast ([c, H])."""
        h_c = self.hidden[sl]
        if self.dh is not None:
            torch.mm(d, self.weight, out=self.dh[sl])
        if self.need_w:
            if self.n_chunks == 1:
                self.dw = d.T @ h_c
            elif d.dtype == torch.float32:
                self.dw.addmm_(d.T, h_c)
            elif d32 is None and d.device.type == "cuda" and _FP32_OUT_MM[0]:
                try:
                    torch.addmm(self.dw, d.T, h_c, out_dtype=torch.float32, out=self.dw)
                except (RuntimeError, TypeError, NotImplementedError):  # a torch without it: upcast instead
                    _FP32_OUT_MM[0] = False
                    self.dw.addmm_(d.T.float(), h_c.float())
            else:
                self.dw.addmm_((d if d32 is None else d32).T.float(), h_c.float())
        if self.db is not None:
            self.db += d.sum(0, dtype=torch.float32)

    def result(self):
        dw = None if self.dw is None else self.dw.to(self.weight.dtype)
        db = None if self.db is None else self.db.to(self.weight.dtype)
        return self.dh, dw, db


def _chunks(T, C):
    return [slice(t0, min(T, t0 + C)) for t0 in range(0, T, C)]


# ---------------------------------------------------------------- forward / backward


def _guard(t, use_triton):
    """Triton launches on the tensors' device, not the current one."""
    if not use_triton:
        return contextlib.nullcontext()
    from ..kernels.segments import device_guard

    return device_guard(t)


def linear_logprobs_fwd(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton):
    """Forward chunk loop: (lse, logp, entropy or None), each [T] fp32."""
    with _guard(hidden, use_triton):
        return _linear_logprobs_fwd(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton)


def _linear_logprobs_fwd(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton):
    T, dev = hidden.shape[0], hidden.device
    lse = _alloc.empty(T, device=dev)
    logp = _alloc.empty(T, device=dev)
    ent = _alloc.empty(T, device=dev) if want_entropy else None
    # the PyTorch path keeps each row's max and log-sum for the backward's log p (see `dlogits`)
    rowmax, logsum = (None, None) if use_triton else (_alloc.empty(T, device=dev), _alloc.empty(T, device=dev))
    ck = _Chunker(hidden, weight, bias, inv_t, C, use_triton, need_tmp=want_entropy)
    for sl in _chunks(T, C):
        ck.stats(sl, targets[sl], lse[sl], logp[sl], None if ent is None else ent[sl],
                 None if rowmax is None else rowmax[sl], None if logsum is None else logsum[sl])
    return lse, logp, ent, rowmax, logsum


def linear_logprobs_bwd(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, inv_t, C, needs, use_triton,
                        rowmax=None, logsum=None):
    """`_linear_logprobs_bwd` on the tensors' device."""
    with _guard(hidden, use_triton):
        return _linear_logprobs_bwd(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, inv_t, C, needs, use_triton,
                                    rowmax, logsum)


def _linear_logprobs_bwd(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, inv_t, C, needs, use_triton,
                         rowmax=None, logsum=None):
    """Backward chunk loop: recompute each chunk's logits, form dL/dz, run the gradient matmuls.

    g_lp, g_ent: [T] upstream gradients (None: that output is unused). Returns (d hidden, d W, d b),
    None where `needs` says no.
    """
    T = hidden.shape[0]
    # fold the temperature's chain-rule factor into the per-token gradients: dL/dl = dL/dz / temperature
    g_lp = (torch.zeros(T, device=hidden.device) if g_lp is None else g_lp.float() * inv_t).contiguous()
    g_ent = None if g_ent is None else (g_ent.float() * inv_t).contiguous()
    chunks = _chunks(T, C)
    ck = _Chunker(hidden, weight, bias, inv_t, C, use_triton, need_tmp=g_ent is not None)
    grads = _Grads(hidden, weight, bias, needs, len(chunks))
    for sl in chunks:
        d, d32 = ck.dlogits(sl, targets[sl], lse[sl], None if g_ent is None else ent[sl], g_lp[sl],
                            None if g_ent is None else g_ent[sl], rowmax=None if rowmax is None else rowmax[sl],
                            logsum=None if logsum is None else logsum[sl])
        grads.add(sl, d, d32)
    return grads.result()


# ---------------------------------------------------------------- custom ops: fake impls and autograd
# Optional outputs are [0] tensors when absent (a custom op returns tensors only).


def _empty0(t):
    return t.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("compactionrl_fast::linear_logprobs_fwd", mutates_args=())
def _fwd_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, inv_t: float, C: int,
            want_entropy: bool, use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(lse, logp, entropy or [0], rowmax or [0], logsum or [0]), each [T] fp32 (see `linear_logprobs_fwd`)."""
    out = linear_logprobs_fwd(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton)
    return tuple(_empty0(hidden) if t is None else t for t in out)


@_fwd_op.register_fake
def _(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton):
    T = hidden.shape[0]
    row = lambda on: hidden.new_empty(T if on else 0, dtype=torch.float32)  # noqa: E731
    return row(True), row(True), row(want_entropy), row(not use_triton), row(not use_triton)


@torch.library.custom_op("compactionrl_fast::linear_logprobs_bwd", mutates_args=())
def _bwd_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, lse: Tensor, ent: Tensor,
            g_lp: Optional[Tensor], g_ent: Optional[Tensor], rowmax: Tensor, logsum: Tensor, inv_t: float, C: int,
            need_hidden: bool, need_weight: bool, need_bias: bool,
            use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(d hidden [T, H], d W [V, H], d b [V]) in the inputs' dtypes, [0] where not needed (see
    `linear_logprobs_bwd`). rowmax, logsum: [0] on the Triton path."""
    out = linear_logprobs_bwd(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, inv_t, C,
                              (need_hidden, need_weight, need_bias), use_triton, None if use_triton else rowmax,
                              None if use_triton else logsum)
    return tuple(hidden.new_empty(0) if g is None else g for g in out)


@_bwd_op.register_fake
def _(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, rowmax, logsum, inv_t, C, need_hidden, need_weight,
      need_bias, use_triton):
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            weight.new_empty((weight.shape[0],) if need_bias else (0,)))


def _fwd_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton = inputs
    lse, _, ent, rowmax, logsum = output
    ctx.save_for_backward(hidden, weight, bias, targets, lse, ent, rowmax, logsum)
    ctx.cfg = (inv_t, C, use_triton)
    ctx.set_materialize_grads(False)  # no zero [T] gradients for unused outputs


def _fwd_backward(ctx, g_lse, g_lp, g_ent, g_rowmax, g_logsum):
    """Recomputes the logits chunk by chunk (the backward op); only logp and the entropy carry gradients."""
    hidden, weight, bias, targets, lse, ent, rowmax, logsum = ctx.saved_tensors
    needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
    if (g_lp is None and g_ent is None) or not any(needs):
        return (None,) * 8
    inv_t, C, use_triton = ctx.cfg
    dh, dw, db = torch.ops.compactionrl_fast.linear_logprobs_bwd(
        hidden, weight, bias, targets, lse, ent, g_lp, g_ent, rowmax, logsum, inv_t, C, *needs, use_triton)
    return (dh if needs[0] else None, dw if needs[1] else None, db if needs[2] else None) + (None,) * 5


torch.library.register_autograd("compactionrl_fast::linear_logprobs_fwd", _fwd_backward,
                                setup_context=_fwd_setup_context)


def _chunk_upstream(token_loss, logp, ent, sl):
    """Value and gradients of the caller's loss on one chunk: (loss, dL/dlogp [c], dL/dentropy [c] or None)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        en = None if ent is None else ent.detach().requires_grad_()
        loss = token_loss(lp, en, sl)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"token_loss must return a one-element tensor, got {type(loss).__name__} "
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        leaves = [lp] if en is None else [lp, en]
        grads = [None] * len(leaves)
        if loss.requires_grad:
            grads = list(torch.autograd.grad(loss.sum(), leaves, allow_unused=True))
    grads = [torch.zeros_like(x) if g is None else g.float() for g, x in zip(grads, leaves)]
    return loss.detach().float().sum(), grads[0], (grads[1] if en is not None else None)


def _check_token_sum(token_loss, device, with_entropy):
    """The loss is the sum of the chunks' shares, which is the loss of all tokens only for a sum over tokens;
    such a loss is 0 on no tokens. One call on an empty chunk refuses the others (a constant, a mean, an
    offset) with a ValueError rather than a loss that depends on the chunk count."""
    empty = torch.zeros(0, device=device)
    with torch.no_grad():
        v = token_loss(empty, empty if with_entropy else None, slice(0, 0))
    if not isinstance(v, torch.Tensor) or v.numel() != 1:
        return  # _chunk_upstream raises the TypeError
    if float(v) != 0.0:
        raise ValueError(f"token_loss must be a sum over tokens (it is called once per chunk and the shares are "
                         f"added), but on an empty chunk it returned {float(v)}, not 0; a constant, a mean or an "
                         f"offset depends on the number of chunks: write it as a sum over the chunk's tokens, or "
                         f"pass chunk_size >= T (one chunk)")


class LinearLogprobsLossFunction(torch.autograd.Function):
    """The fused variant: the caller's loss is applied chunk by chunk inside the forward loop, so each
    chunk's gradients come from logits still in the buffer (3 matmuls, no recompute). Backward only
    scales the stored gradients by the upstream scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_loss, inv_t, C, want_entropy, use_triton):
        with _guard(hidden, use_triton):
            return LinearLogprobsLossFunction._forward(ctx, hidden, weight, bias, targets, token_loss, inv_t, C,
                                                       want_entropy, use_triton)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, targets, token_loss, inv_t, C, want_entropy, use_triton):
        T, dev = hidden.shape[0], hidden.device
        lse, logp = _alloc.empty(T, device=dev), _alloc.empty(T, device=dev)
        ent = _alloc.empty(T, device=dev) if want_entropy else None
        chunks = _chunks(T, C)
        ck = _Chunker(hidden, weight, bias, inv_t, C, use_triton, need_tmp=want_entropy)
        grads = _Grads(hidden, weight, bias, tuple(ctx.needs_input_grad[:3]), len(chunks))
        total = torch.zeros((), device=dev)
        for sl in chunks:
            y, e = targets[sl], None if ent is None else ent[sl]
            state = ck.stats(sl, y, lse[sl], logp[sl], e)
            loss, g_lp, g_ent = _chunk_upstream(token_loss, logp[sl], e, sl)
            total += loss
            d, d32 = ck.dlogits(sl, y, lse[sl], e, g_lp * inv_t, None if g_ent is None else g_ent * inv_t, state)
            grads.add(sl, d, d32)
        ctx.grads = grads.result()
        ctx.mark_non_differentiable(logp, *([ent] if want_entropy else []))
        return (total, logp, ent) if want_entropy else (total, logp)

    @staticmethod
    def backward(ctx, g_loss, *unused):
        if ctx.grads is None:
            raise RuntimeError(
                "linear_logprobs_loss: backward ran a second time through the same loss (retain_graph=True): "
                "its gradients are formed in the forward pass and handed out by the first backward only; "
                "call linear_logprobs_loss again for another backward")
        grads, ctx.grads = ctx.grads, None  # handed out (and scaled in place) once
        # the common loss.backward() passes 1: skip the scaling then (a free check on CPU; on CUDA it
        # would be a host sync, so the gradients are always scaled there)
        one = g_loss.device.type == "cpu" and not torch.compiler.is_compiling() and g_loss.item() == 1.0
        dh, dw, db = (g if g is None or one else g.mul_(g_loss.to(g.dtype)) for g in grads)
        return dh, dw, db, None, None, None, None, None, None


# ---------------------------------------------------------------- public function


def _check_inputs(hidden, weight, targets, bias, temperature, chunk_size, return_entropy,
                  entropy_name="return_entropy"):
    check_tensor("hidden", hidden, dtypes=HIDDEN_DTYPES, ndim=2)
    dev = hidden.device
    check_tensor("weight", weight, dtypes=(hidden.dtype,), ndim=2, device=dev)
    T, H = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight must be [V, H] with H={H} (hidden's last dim), got shape {tuple(weight.shape)}")
    if V == 0:
        raise ValueError("weight must have at least one row (vocabulary size V >= 1)")
    check_tensor("targets", targets, dtypes=(torch.int64, torch.int32), ndim=1, device=dev, numel=T)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,), ndim=1, device=dev, numel=V)
    temperature = check_float("temperature", temperature, 0.0, float("inf"))
    if not 0.0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature}")
    if 1.0 / temperature > FLOAT32_MAX:
        raise ValueError(f"temperature={temperature} is too small: the logits are scaled by 1/temperature in "
                         f"float32, and 1/{temperature} overflows it (> {FLOAT32_MAX:.4g})")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not isinstance(return_entropy, bool):
        raise TypeError(f"{entropy_name} must be a bool, got {type(return_entropy).__name__}")
    if T and value_checks(targets):  # reads targets (a host sync on CUDA: only with COMPACTIONRL_FAST_CHECKS=1)
        lo, hi = (int(x) for x in torch.stack([targets.min(), targets.max()]).tolist())
        if lo < 0 or hi >= V:
            bad = int(torch.nonzero((targets < 0) | (targets >= V))[0])
            raise ValueError(f"targets must be in [0, V={V}), got targets[{bad}]={int(targets[bad])}")
    return temperature


def _resolve_backend(backend, device, dtype):
    # CPU tensors run the PyTorch chunk loop (the table's order); the Triton kernels on CPU exist only for the
    # interpreter
    b = resolve_backend(backend, device, op="linear_logprobs")  # a constant to torch.compile
    if b == "triton" and device.type != "cuda" and dtype != torch.float32:
        raise ValueError("backend='triton' on CPU tensors (the Triton interpreter) supports float32 only: the "
                         "interpreter's bf16/fp16 arithmetic is unreliable; use backend='torch'")
    return b


def linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, chunk_size=None,
                    return_entropy=False, backend="auto"):
    """Log-probs of `targets` (and the entropy) under softmax((hidden @ weight.T + bias) / temperature).

    Never materialises the [T, V] logits: tokens are processed in chunks of `chunk_size` rows, and
    backward recomputes each chunk's logits. Gradients flow to hidden, weight and bias from both outputs.

    Args:
        hidden: [T, H] bf16/fp16/fp32 final hidden states.
        weight: [V, H] LM-head weight, hidden's dtype.
        targets: [T] int64 (or int32) token ids in [0, V). Checked where value checks run (CPU tensors,
            or COMPACTIONRL_FAST_CHECKS=1: a ValueError); unchecked (CUDA by default), an out-of-range
            target gives logp NaN and no one-hot term in its row's gradient, never an out-of-bounds read.
        bias: [V] or None, hidden's dtype.
        temperature: float > 0, the sampler's temperature (logits are divided by it).
        chunk_size: rows per chunk; None picks about 64 MB of fp32 logits on CPU, 512 MB on CUDA.
        return_entropy: also return the entropy -sum_v p log p of each token's distribution.
        backend: "auto" (CUDA: "triton"; CPU: "torch") | "triton" | "torch".

    Returns:
        logprobs [T] float32, or (logprobs [T] float32, entropy [T] float32).

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> h, W = torch.randn(5, 8), torch.randn(11, 8)
        >>> y = torch.tensor([0, 3, 10, 2, 2])
        >>> lp, ent = crf.linear_logprobs(h, W, y, temperature=0.7, return_entropy=True, chunk_size=2)
        >>> ref = torch.log_softmax(h @ W.T / 0.7, -1)
        >>> torch.allclose(lp, ref[torch.arange(5), y], atol=1e-5)
        True
        >>> torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
        True
    """
    temperature = _check_inputs(hidden, weight, targets, bias, temperature, chunk_size, return_entropy)
    b = _resolve_backend(backend, hidden.device, hidden.dtype)
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk_size if chunk_size is not None else default_chunk_size(T, V, hidden.device)
    C = max(1, min(C, T))
    _, logp, ent, _, _ = torch.ops.compactionrl_fast.linear_logprobs_fwd(
        hidden, weight, bias, targets.long().contiguous(), 1.0 / temperature, C, return_entropy, b == "triton")
    return (logp, ent) if return_entropy else logp


def linear_logprobs_loss(hidden, weight, targets, token_loss, *, bias=None, temperature=1.0, chunk_size=None,
                         with_entropy=False, backend="auto"):
    """The fused variant: a loss of the log-probs (and entropy) whose gradients are formed in the forward pass.

    `token_loss(logprobs_c, entropy_c, sl)` is called once per token chunk `sl` (a slice of token indices)
    with the chunk's log-probs [c] (and entropy [c], or None unless `with_entropy`) and returns that chunk's
    scalar share of the loss; the loss is the sum of the shares. The loss must therefore be a sum over
    tokens, such as a PPO loss with a known denominator; index your own per-token tensors (advantages,
    old log-probs, mask) with `sl`. With more than one chunk, where value checks run (CPU tensors, or
    COMPACTIONRL_FAST_CHECKS=1), `token_loss` is first called once on an empty chunk (`sl` = slice(0, 0)):
    a value other than 0 there (a constant, a mean, an offset: not a sum over
    tokens) is a ValueError. Its gradients with respect to hidden, weight and bias are formed
    while each chunk's logits are in the buffer: 3 matmuls where `linear_logprobs` + autograd runs 4.
    Tensors captured by `token_loss` receive no gradient. Backward scales the stored gradients by the
    upstream gradient of the loss; they are held from forward to backward ([T, H] + [V, H] + [V]).
    Unlike `linear_logprobs` this is a torch.autograd.Function, not a custom op (an op schema cannot
    carry the Python callable `token_loss`): torch.compile runs it outside the graph.

    Args: as `linear_logprobs`; `with_entropy` passes (and returns) the entropy.

    Returns:
        (loss, logprobs [T] float32, entropy [T] float32 or None when not with_entropy), loss a 0-dim float32
        tensor that is differentiable; logprobs and entropy are not (they are for metrics).

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> h, W = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
        >>> y, adv = torch.tensor([0, 3, 10, 2, 2, 5]), torch.randn(6)
        >>> loss, lp, _ = crf.linear_logprobs_loss(h, W, y, lambda lp, ent, sl: -(adv[sl] * lp).sum() / 6,
        ...                                        chunk_size=4)
        >>> loss.backward()
        >>> ref = -(adv * torch.log_softmax(h @ W.T, -1)[torch.arange(6), y]).sum() / 6
        >>> gh, = torch.autograd.grad(ref, h)
        >>> torch.allclose(h.grad, gh, atol=1e-5) and torch.allclose(loss, ref, atol=1e-5)
        True
    """
    temperature = _check_inputs(hidden, weight, targets, bias, temperature, chunk_size, with_entropy,
                                entropy_name="with_entropy")
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable (logprobs_c, entropy_c, sl) -> scalar, got "
                        f"{type(token_loss).__name__}")
    b = _resolve_backend(backend, hidden.device, hidden.dtype)
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk_size if chunk_size is not None else default_chunk_size(T, V, hidden.device)
    C = max(1, min(C, T))
    if T > C and value_checks(hidden):  # a host read of its value: CPU, or COMPACTIONRL_FAST_CHECKS=1
        _check_token_sum(token_loss, hidden.device, with_entropy)
    out = LinearLogprobsLossFunction.apply(hidden, weight, bias, targets.long().contiguous(), token_loss,
                                           1.0 / temperature, C, with_entropy, b == "triton")
    return out if with_entropy else (*out, None)
