"""The chunk loop of `linear_logprobs` (compactionrl_fast/ops/linear_logprobs.py): the op's torch backend
and the driver of its Triton kernels.

Tokens go in chunks of C rows: the logits `hidden_c @ W.T + b` of a chunk go into one [C, V] buffer (a
BLAS / cuBLAS matmul), then the per-row softmax work on z = logits / temperature runs on it, in PyTorch
or in the Triton kernels of kernels/linear_logprobs.py (which launch on the tensors' device). Backward
recomputes each chunk's logits, turns them into dL/dz in place and runs the two gradient matmuls.

Gradients of both outputs with respect to z (p = softmax(z), H = entropy, one-hot of the target e_y):
    d logp / dz = e_y - p            d H / dz = -p * (log p + H)
"""
from __future__ import annotations

import torch

from ..kernels._launch import empty

# log p below which p is 0 in float32 (exp(-104) flushes): the entropy gradient clamps log p there, so that
# g * log p stays finite where p = 0 (tiny temperatures make log p ~ -1e30, and 0 * inf is NaN)
LOG_P_FLOOR = -1.0e4


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
        # mul + pairwise sum: 10x more precise than a bmm dot; p log p = 0 at a -inf logit (0 * -inf = NaN;
        # a NaN or +inf logit makes log s NaN anyway)
        ent.copy_(log_s - e.mul_(z).nan_to_num_(nan=0.0).sum(1) / s)
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
        self.dh = empty(*hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
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


def linear_logprobs_fwd(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton):
    """Forward chunk loop: (lse, logp, entropy or None, rowmax, logsum), each [T] fp32 (rowmax and logsum:
    the PyTorch path only, else None)."""
    T, dev = hidden.shape[0], hidden.device
    lse = empty(T, device=dev)
    logp = empty(T, device=dev)
    ent = empty(T, device=dev) if want_entropy else None
    # the PyTorch path keeps each row's max and log-sum for the backward's log p (see `dlogits`)
    rowmax, logsum = (None, None) if use_triton else (empty(T, device=dev), empty(T, device=dev))
    ck = _Chunker(hidden, weight, bias, inv_t, C, use_triton, need_tmp=want_entropy)
    for sl in _chunks(T, C):
        ck.stats(sl, targets[sl], lse[sl], logp[sl], None if ent is None else ent[sl],
                 None if rowmax is None else rowmax[sl], None if logsum is None else logsum[sl])
    return lse, logp, ent, rowmax, logsum


def linear_logprobs_bwd(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, inv_t, C, needs, use_triton,
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


def fused_forward(hidden, weight, bias, targets, token_loss, inv_t, C, want_entropy, use_triton, needs):
    """The fused variant's chunk loop: (loss [], logp [T], entropy [T] or None, (d hidden, d W, d b)), the
    caller's loss applied to each chunk while its logits are in the buffer (`linear_logprobs_loss`)."""
    T, dev = hidden.shape[0], hidden.device
    lse, logp = empty(T, device=dev), empty(T, device=dev)
    ent = empty(T, device=dev) if want_entropy else None
    chunks = _chunks(T, C)
    ck = _Chunker(hidden, weight, bias, inv_t, C, use_triton, need_tmp=want_entropy)
    grads = _Grads(hidden, weight, bias, needs, len(chunks))
    total = torch.zeros((), device=dev)
    for sl in chunks:
        y, e = targets[sl], None if ent is None else ent[sl]
        state = ck.stats(sl, y, lse[sl], logp[sl], e)
        loss, g_lp, g_ent = _chunk_upstream(token_loss, logp[sl], e, sl)
        total += loss
        d, d32 = ck.dlogits(sl, y, lse[sl], e, g_lp * inv_t, None if g_ent is None else g_ent * inv_t, state)
        grads.add(sl, d, d32)
    return total, logp, ent, grads.result()
