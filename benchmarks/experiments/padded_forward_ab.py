"""The padded training forward's layout, A/B at 1 thread (issue 41): what a different call layout gains.

    OMP_NUM_THREADS=1 python benchmarks/experiments/padded_forward_ab.py [--sft-steps 30] [--reps 5]

On the demo's PPO step (real batches of 2 steps after a short SFT, 3 epochs, `train_step` as the trainer runs it,
fresh copies of the actor and critic each call, variants round-robin, medians):
  cap N      the padded forward's buckets split so that no decoder call takes more than N padded tokens
             (smaller activations for the caches; changes the weight gradients' summation order)
  causal     no padding mask: right-padded rows need none under causal attention, and pad positions that
             count on let HF take SDPA's is_causal path (the real tokens' numbers should be bitwise the same)
Prints the speed-ups against the layout `forward_tables` builds now, and whether `causal` is bitwise equal.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.experiments.demo_speed_ab import load, ppo_step_data  # noqa: E402
from compactionrl_fast.train import model as M  # noqa: E402
from compactionrl_fast.train.trainer import make_state, train_step  # noqa: E402


def capped(tables, cap):
    """The buckets of `tables` split into calls of at most `cap` padded tokens (rows * width)."""
    out = []
    for seq, col, tok, mask, keep, slot, *_ in tables:
        A, L = mask.shape
        rows = max(1, cap // L)
        at = None if keep is None else torch.full_like(tok, -1).index_put_((keep,), slot)  # slot of each token
        for r0 in range(0, A, rows):
            sel = (seq >= r0) & (seq < r0 + rows)
            m = mask[r0:r0 + rows]
            k = s = None
            if at is not None:
                k = (at[sel] >= 0).nonzero()[:, 0]
                s = at[sel][k]
            out.append((seq[sel] - r0, col[sel], tok[sel], m[:, :int(m.sum(1).max())].contiguous(), k, s))
    return out


def causal_hidden(model, input_ids, position_ids, cu_attn, *, positions=None, pad_ratio=0.8, tables=None):
    """packed_hidden without the padding mask (pads at positions counting on past each row's end); the full
    forward (every layer at every position), then `positions`."""
    dec = M.decoder(model)
    hidden = None
    for seq, col, tok, mask, *_ in tables if tables is not None else M.forward_tables(cu_attn, pad_ratio):
        A, L = mask.shape
        ids = input_ids.new_zeros(A, L).index_put_((seq, col), input_ids[tok])
        pos = torch.arange(L).repeat(A, 1).index_put_((seq, col), position_ids[tok])
        h = dec(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[seq, col]
        hidden = (h.new_zeros(input_ids.numel(), h.shape[-1]) if hidden is None else hidden).index_copy(0, tok, h)
    return hidden if positions is None else hidden[positions]


def bitwise(actor, mbs, original) -> bool:
    """Hidden states and the decoder's gradients of a fixed random projection of them: `causal` vs now."""
    out = []
    for fn in (original, causal_hidden):
        model = copy.deepcopy(actor)
        g = torch.Generator().manual_seed(0)
        res = []
        for m in mbs:
            h = fn(model, m.batch.input_ids, m.batch.position_ids, m.batch.cu_attn, tables=m.tables)[m.idx - 1]
            (h * torch.randn(h.shape, generator=g)).sum().backward()
            res.append(h.detach())
        out.append(res + [q.grad.clone() for q in M.decoder(model).parameters() if q.grad is not None])
    return len(out[0]) == len(out[1]) and all(torch.equal(x, y) for x, y in zip(*out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    cfg, data, actor, critic = ppo_step_data(a.sft_steps)
    variants = {"now": lambda t: t, "cap 4096": lambda t: capped(t, 4096), "cap 2048": lambda t: capped(t, 2048),
                "causal": lambda t: t}
    steps = {k: [([type(m)(**{**vars(m), "tables": f(m.tables)}) for m in b], mb) for _, b, mb in data]
             for k, f in variants.items()}
    original = M.packed_hidden

    def run(k):
        M.packed_hidden = causal_hidden if k == "causal" else original
        st = make_state(cfg, copy.deepcopy(actor), copy.deepcopy(critic))
        t = time.perf_counter()
        for b, mb in steps[k]:
            train_step(st, b, minibatches=mb, diagnose=False)
        dt = time.perf_counter() - t
        M.packed_hidden = original
        return dt

    times = {k: [] for k in variants}
    for r in range(a.reps):
        for k in variants:
            times[k].append(run(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    same = bitwise(actor, [m for _, b, _ in data for m in b], original)
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    print(f"{isa}: 2 PPO steps (3 epochs), median of {a.reps}: "
          + ", ".join(f"{k} {v:.2f} s ({med['now'] / v:.3f}x)" for k, v in med.items())
          + f"; causal's hidden states and gradients bitwise equal to now's: {same}; load {load()}")


if __name__ == "__main__":
    main()
