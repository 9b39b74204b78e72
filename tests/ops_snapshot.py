"""Every public op's outputs and gradients on a fixed set of inputs, every CPU backend (torch, cpp, Triton
interpreted), both index dtypes, every mode: a before/after check for refactors that must not change behaviour.

    python -m tests.ops_snapshot --save /tmp/before.pt      # on the old revision
    python -m tests.ops_snapshot --compare /tmp/before.pt   # on the new one: "0 differences", exit 0

Each op runs on its CPU backends from the dispatch table (compactionrl_fast/ops/_dispatch.py) and its modes come
from kernels/modes.py, so a new backend or mode is snapshotted without an edit here; every registered op also
runs on its spec's cases (compactionrl_fast/ops/_registry.py), so a new op is too. Cases only in the new
snapshot are listed as new, not as differences. `--old-names` compares with a snapshot saved before the tuned
PyTorch paths were named "torch-tuned" (when "torch" meant them for place_final_rewards, value_head and
linear_logprobs): its keys are renamed first.

Bitwise on one machine with 1 thread (torch's matmuls round differently on other CPUs and thread counts: compare
snapshots made on the same machine). A combination that raises is recorded as its message. About 4 min on 2 cores.
"""
import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

torch.set_num_threads(1)
import compactionrl_fast as crf  # noqa: E402
from compactionrl_fast.kernels import modes  # noqa: E402
from compactionrl_fast.ops._dispatch import TABLE  # noqa: E402
from compactionrl_fast.ops._registry import public_specs  # noqa: E402
from tests.ops.registry_runs import run  # noqa: E402


def backends(op):
    """The op's CPU backends, as the dispatch table lists them."""
    return TABLE[op]["cpu"]


# ops (key prefixes) whose "torch" was the tuned path in snapshots saved before "torch-tuned" existed
OLD_TORCH_TUNED = ("place", "vhead", "llp", "llploss")


def batch(idx_dtype, seed=0):
    """Segments with: empty, no trainable token, single token, long (several kernel blocks), ordinary."""
    g = torch.Generator().manual_seed(seed)
    lens = [5, 0, 1, 2600, 7, 0, 3, 40, 1, 900, 12]
    cu = torch.tensor([0] + lens).cumsum(0)
    T = int(cu[-1])
    mask = torch.rand(T, generator=g) < 0.7
    mask[cu[3]:cu[3] + 1] = False           # a segment whose only token is not trainable
    mask[cu[7]:cu[8]] = False               # a 40-token segment with no trainable token
    cu_seg = torch.tensor([0, 3, 4, 8, 11])  # rollouts of 3, 1, 4, 3 segments
    r = torch.randn(T, generator=g)
    v = torch.randn(T, generator=g)
    return dict(T=T, S=len(lens), R=4, mask=mask, cu=cu.to(idx_dtype), cu_seg=cu_seg.to(idx_dtype), r=r, v=v, g=g)


def gae_cases(b, add):
    S, T = b["S"], b["T"]
    lam_t = torch.rand(S, generator=b["g"])
    perm = torch.randperm(S, generator=b["g"])
    lens = b["cu"].long().diff()
    start = torch.zeros(S, dtype=torch.int64)
    start[perm] = torch.cat([torch.zeros(1, dtype=torch.int64), lens[perm].cumsum(0)[:-1]])
    for cross in modes.CROSS_SEGMENT:
        for lam, al in ((0.95, "rollout"), ("adaptive", "rollout"), ("adaptive", "segment"), (lam_t, "rollout")):
            for lam_c in (1.0, None):
                for gamma, st in ((1.0, None), (0.97, None), (0.99, start)):
                    kw = dict(gamma=gamma, lam=lam, cross_segment=cross, lam_critic=lam_c, adaptive_length=al,
                              seg_start=st)
                    key = (f"gae/{cross}/{'tensor' if isinstance(lam, torch.Tensor) else lam}/{al}/lc{lam_c}"
                           f"/g{gamma}/start{st is not None}")
                    for be in backends("segment_gae"):
                        add(key + "/" + be, lambda be=be, kw=kw: crf.segment_gae(
                            b["r"], b["v"], b["mask"], b["cu"], b["cu_seg"], backend=be, **kw))
    rr = torch.randn(b["R"], generator=b["g"])
    for mode in modes.REWARD_PLACEMENT:
        add(f"place/{mode}", lambda mode=mode: crf.place_final_rewards(rr, b["mask"], b["cu"], b["cu_seg"], mode=mode))
        for be in backends("place_final_rewards"):
            add(f"place/{mode}/{be}", lambda mode=mode, be=be: crf.place_final_rewards(
                rr, b["mask"], b["cu"], b["cu_seg"], mode=mode, backend=be))


def grad_of(fn, *leaves):
    out = fn(*leaves)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return out, [x.grad for x in leaves]


def loss_cases(b, add):
    T, g = b["T"], b["g"]
    lp = torch.randn(T, generator=g) * 0.3 - 1
    old = lp + torch.randn(T, generator=g) * 0.2
    roll = old + torch.randn(T, generator=g) * 0.1
    adv = torch.randn(T, generator=g)
    ret = torch.randn(T, generator=g)
    for red in modes.REDUCTION:
        for den in (None, 37.0):
            for name, kw in (("plain", {}), ("asym", dict(clip_low=0.1, clip_high=0.3)), ("dual", dict(dual_clip=3.0)),
                             ("tis", dict(rollout_logprobs=roll, tis_cap=2.0)), ("tis_nocap", dict(rollout_logprobs=roll))):
                for be in backends("ppo_policy_loss"):
                    def f(be=be, kw=kw, red=red, den=den):
                        x = lp.clone().requires_grad_()
                        return grad_of(lambda x: crf.ppo_policy_loss(x, old, adv, b["mask"], cu_seqlens=b["cu"],
                                       cu_segments=b["cu_seg"], reduction=red, denominator=den, backend=be, **kw), x)
                    add(f"ppo/{red}/den{den}/{name}/{be}", f)
            for clip in (None, 0.2):
                for be in backends("value_loss"):
                    def f(be=be, clip=clip, red=red, den=den):
                        x = b["v"].clone().requires_grad_()
                        return grad_of(lambda x: crf.value_loss(x, b["v"] + 0.1, ret, b["mask"], clip=clip,
                                       cu_seqlens=b["cu"], cu_segments=b["cu_seg"], reduction=red, denominator=den,
                                       backend=be), x)
                    add(f"vloss/{red}/den{den}/clip{clip}/{be}", f)
        if red != "sum":
            add(f"gden/{red}", lambda red=red: crf.global_denominator(red, b["mask"], cu_seqlens=b["cu"],
                                                                     cu_segments=b["cu_seg"], as_tensor=True))
    add("gcount", lambda: crf.global_token_count(b["mask"], as_tensor=True))


def head_cases(b, add):
    T, g = b["T"], b["g"]
    H = 64
    h = torch.randn(T, H, generator=g)
    w = torch.randn(H, generator=g) * 0.1
    bias = torch.randn((), generator=g)
    ret = torch.randn(T, generator=g)
    for dt in (torch.float32, torch.bfloat16):
        for with_bias in (False, True):
            for be in backends("value_head"):
                def f(be=be, dt=dt, with_bias=with_bias):
                    hh, ww = h.to(dt).clone().requires_grad_(), w.to(dt).clone().requires_grad_()
                    bb = bias.clone().requires_grad_() if with_bias else None
                    out = crf.value_head(hh, ww, bb, backend=be)
                    (out.float() * ret).sum().backward()
                    return out, [hh.grad, ww.grad] + ([bb.grad] if with_bias else [])
                add(f"vhead/{dt}/bias{with_bias}/{be}", f)
    for red in ("token-mean", "rollout-mean"):
        for be in backends("value_head"):
            def f(be=be, red=red):
                hh, ww, bb = h.clone().requires_grad_(), w.clone().requires_grad_(), bias.clone().requires_grad_()
                return grad_of(lambda hh, ww, bb: crf.value_head_loss(hh, ww, bb, b["v"], ret, b["mask"], clip=0.2,
                               cu_seqlens=b["cu"], cu_segments=b["cu_seg"], reduction=red, backend=be), hh, ww, bb)
            add(f"vheadloss/{red}/{be}", f)


def logprob_cases(b, add):
    g = b["g"]
    T, H, V = 300, 32, 97
    h = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.2
    bias = torch.randn(V, generator=g) * 0.1
    y = torch.randint(0, V, (T,), generator=g)
    for be in backends("linear_logprobs"):
        for temp in (1.0, 0.7):
            for chunk in (None, 64):
                for ent in (False, True):
                    for with_bias in (False, True):
                        def f(be=be, temp=temp, chunk=chunk, ent=ent, with_bias=with_bias):
                            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                            bb = bias.clone().requires_grad_() if with_bias else None
                            out = crf.linear_logprobs(hh, ww, y, bias=bb, temperature=temp, chunk_size=chunk,
                                                      return_entropy=ent, backend=be)
                            lp = out[0] if ent else out
                            s = (lp * torch.linspace(-1, 1, T)).sum() + (out[1].sum() * 0.3 if ent else 0)
                            s.backward()
                            return out, [hh.grad, ww.grad] + ([bb.grad] if with_bias else [])
                        add(f"llp/{temp}/{chunk}/ent{ent}/bias{with_bias}/{be}", f)
            def f2(be=be, temp=temp):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                wt = torch.linspace(0, 1, T)
                out = crf.linear_logprobs_loss(hh, ww, y, lambda lp, en, sl: -(lp * wt[sl]).sum() - 0.1 * en.sum(),
                                               temperature=temp, chunk_size=64, with_entropy=True, backend=be)
                loss = out[0] if isinstance(out, tuple) else out
                loss.backward()
                return out, [hh.grad, ww.grad]
            add(f"llploss/{temp}/{be}", f2)


def registered_cases(b, add):
    """Every registered op's spec cases (compactionrl_fast/ops/_registry.py) on its CPU backends: a new op is
    snapshotted with no edit here. The index dtype comes from the cases, so only the int32 pass runs them."""
    if b["cu"].dtype != torch.int32:
        return
    for spec in public_specs():
        for case, kw in spec.cases(torch.device("cpu")).items():
            for be in backends(spec.name):
                add(f"reg/{spec.name}/{case}/{be}", lambda spec=spec, kw=kw, be=be: run(spec, kw, be))


def flatten(x):
    if isinstance(x, torch.Tensor):
        return [x.detach().clone()]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in [k] + flatten(x[k])]
    if isinstance(x, (tuple, list)):
        return [t for e in x for t in flatten(e)]
    return [x]


def collect():
    snap = {}
    for idx_dtype in (torch.int32, torch.int64):
        b = batch(idx_dtype)
        pre = f"{str(idx_dtype)[6:]}/"

        def add(key, fn):
            try:
                snap[pre + key] = flatten(fn())
            except Exception as e:  # an unsupported combination is part of the behaviour too
                snap[pre + key] = [f"{type(e).__name__}: {e}"]
        gae_cases(b, add)
        loss_cases(b, add)
        head_cases(b, add)
        logprob_cases(b, add)
        registered_cases(b, add)
        print(f"{pre}: {len(snap)} cases", flush=True)
    return snap


def same(a, b):
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if not isinstance(a, torch.Tensor):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.view(torch.uint8) if a.numel() == 0 else a.contiguous().view(-1).view(torch.uint8),
                           b.view(torch.uint8) if b.numel() == 0 else b.contiguous().view(-1).view(torch.uint8))
    return torch.equal(a, b)


def renamed(key):
    """A key of a snapshot saved before "torch-tuned": ".../torch" of the ops whose torch was the tuned path."""
    op = key.split("/")[1]
    return key[:-len("torch")] + "torch-tuned" if op in OLD_TORCH_TUNED and key.endswith("/torch") else key


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--save")
    ap.add_argument("--compare")
    ap.add_argument("--old-names", action="store_true", help="the --compare snapshot predates \"torch-tuned\"")
    a = ap.parse_args()
    snap = collect()
    errors = sum(1 for v in snap.values() if len(v) == 1 and isinstance(v[0], str))
    print(f"{len(snap)} cases, {errors} raised")
    if a.save:
        torch.save(snap, a.save)
    if a.compare:
        ref = torch.load(a.compare)
        if a.old_names:
            ref = {renamed(k): v for k, v in ref.items()}
        new = sorted(set(snap) - set(ref))
        diff = [k for k in sorted(ref)
                if k not in snap or len(ref[k]) != len(snap[k]) or not all(same(x, y) for x, y in zip(ref[k], snap[k]))]
        for k in diff[:40]:
            print("DIFF", k, "" if k in snap else "(missing in the new snapshot)")
        for k in new[:40]:
            print("NEW", k)
        print(f"{len(new)} new cases")
        print(f"{len(diff)} differences")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
