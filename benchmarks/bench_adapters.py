"""Trainer adapters vs the ops on pre-packed data and vs peers' formulations, on padded [B, L] batches.

Each shape is a padded batch with ~30% observation tokens inside the responses and right padding; "compacted"
rows share rollout ids (2-3 rows per rollout, rows of one rollout scattered through the batch). Rows:
  op packed        the op on the batch already packed (padding removed, observation tokens kept, as `pack` does)
  adapter          the package's adapter (segment_gae_padded, verl `compaction` loss, OpenRLHF ValueLoss)
  adapter (pack)   the previous adapter path: packed_layout + pack/unpack around the op
  peers            verl, OpenRLHF, TRL, slime, torchrl on the same padded tensors (benchmarks/peers.py: the
                   installed peer where importable, run with PYTHONPATH=build/peers after `make test-integrations`;
                   else restated, the source file named there); they treat each row as its own episode
"row/adapter" is the row's time over the adapter's (> 1: the adapter is faster); "x op" is the op's
time over the row's.

    python -m benchmarks.bench_adapters [--quick] [--threads 1] [--json PATH]
"""
from __future__ import annotations

import argparse

import torch

import compactionrl_fast as crf
from benchmarks import _harness as H
from benchmarks import peers
from compactionrl_fast.integrations import openrlhf, packed_layout, segment_gae_padded, verl

SHAPES = {"128x8192": (128, 8192), "16x65536": (16, 65536)}
QUICK_SHAPES = {"32x1024": (32, 1024)}


def make_batch(B, L, compacted, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(L - L // 8, L + 1, (B,), generator=g)  # up to 1/8 of a row is padding
    inside = torch.arange(L)[None, :] < lengths[:, None]
    mask = inside & (torch.rand(B, L, generator=g) > 0.3)  # ~30% observation tokens inside each response
    rew = torch.zeros(B, L)
    rew[torch.arange(B), lengths - 1] = torch.randn(B, generator=g)
    mask[torch.arange(B), lengths - 1] = True
    val = torch.randn(B, L, generator=g)
    if compacted:  # 2-3 rows per rollout, the rows of one rollout scattered through the batch
        ids = (torch.arange(B) // 3)[torch.randperm(B, generator=g)].tolist()
    else:
        ids = list(range(B))
    logp = torch.randn(B, L, generator=g) * 0.3 - 1
    old = logp + 0.1 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, L, generator=g)
    return dict(mask=mask, inside=inside, rew=rew, val=val, ids=ids, logp=logp, old=old, adv=adv)


def _old_gae_adapter(b, kw):
    lay = packed_layout(b["mask"], b["ids"])
    adv, ret = crf.segment_gae(lay.pack(b["rew"]), lay.pack(b["val"]), lay.loss_mask, lay.cu_seqlens,
                               lay.cu_segments, **kw)
    return lay.unpack(adv), lay.unpack(ret)


def bench_shape(shape, B, L, compacted, budget_s):
    b = make_batch(B, L, compacted)
    T = B * L
    tag = f"{shape} {'compacted' if compacted else 'one row each'}"
    rows = []
    cfg = dict(shape=tag, op="gae")
    kw = dict(gamma=1.0, lam=0.95, cross_segment="paper")
    lay = packed_layout(b["mask"], b["ids"], keep=b["inside"])  # packed as pack() does: padding out, observations in
    packed = (lay.pack(b["rew"]), lay.pack(b["val"]), lay.loss_mask, lay.cu_seqlens, lay.cu_segments)
    nbytes = 17 * T
    rows.append(H.measure("op packed", lambda: crf.segment_gae(*packed, **kw), config=cfg, budget_s=budget_s,
                          nbytes=nbytes))
    rows.append(H.measure("adapter", lambda: segment_gae_padded(b["rew"], b["val"], b["mask"], b["ids"], **kw),
                          config=cfg, budget_s=budget_s, nbytes=nbytes))
    rows.append(H.measure("adapter (pack)", lambda: _old_gae_adapter(b, kw), config=cfg, budget_s=budget_s,
                          nbytes=nbytes))
    mask_f = b["mask"].float()  # the peers' masks are float (verl subtracts it from 1)
    for name, fn in peers.gae_rows():
        loop = "chunked" not in name and "torchrl" not in name  # per-step Python loops: seconds per call
        rows.append(H.measure(name, lambda fn=fn: fn(b["rew"], b["val"], mask_f, 1.0, 0.95), config=cfg,
                              budget_s=budget_s, nbytes=nbytes, **(dict(min_reps=1, warmup=1, memory=False) if loop else {})))

    cfg = dict(shape=tag, op="policy loss fwd+bwd")
    lp_packed = lay.pack(b["logp"])
    old_p, adv_p = lay.pack(b["old"]), lay.pack(b["adv"])

    def op_packed():
        x = lp_packed.clone().requires_grad_()
        loss, _ = crf.ppo_policy_loss(x, old_p, adv_p, lay.loss_mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
        loss.backward()

    def adapter():
        x = b["logp"].clone().requires_grad_()
        loss, _ = verl.compute_policy_loss_compaction(b["old"], x, b["adv"], b["mask"], "token-mean",
                                                      {"clip_ratio": 0.2, "clip_ratio_c": 3.0})
        loss.backward()

    def peer(fn):
        def run():
            x = b["logp"].clone().requires_grad_()
            fn(x, b["old"], b["adv"], mask_f).backward()
        return run

    nbytes = 17 * T
    rows.append(H.measure("op packed", op_packed, config=cfg, budget_s=budget_s, nbytes=nbytes))
    rows.append(H.measure("adapter", adapter, config=cfg, budget_s=budget_s, nbytes=nbytes))
    for name, fn in peers.policy_loss_rows():
        rows.append(H.measure(name, peer(fn), config=cfg, budget_s=budget_s, nbytes=nbytes))

    cfg = dict(shape=tag, op="value loss fwd+bwd")
    vl = openrlhf.ValueLoss(0.2)

    def v_op_packed():
        x = lp_packed.clone().requires_grad_()
        loss, _ = crf.value_loss(x, old_p, adv_p, lay.loss_mask, clip=0.2)
        loss.backward()

    def v_adapter():
        x = b["logp"].clone().requires_grad_()
        vl(x, b["old"], b["adv"], b["mask"]).backward()

    rows.append(H.measure("op packed", v_op_packed, config=cfg, budget_s=budget_s, nbytes=nbytes))
    rows.append(H.measure("adapter", v_adapter, config=cfg, budget_s=budget_s, nbytes=nbytes))
    for name, fn in peers.value_loss_rows():
        rows.append(H.measure(name, peer(fn), config=cfg, budget_s=budget_s, nbytes=nbytes))
    for r in rows:
        r["group"] = f"{r['shape']} {r['op']}"
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (seconds), for CI")
    p.add_argument("--json", help="write rows to this JSON path (and a markdown table next to it, .md)")
    p.add_argument("--device", default="cpu", choices=("cpu",), help="CPU only for now")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row (min 3 reps)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    H.settle_malloc()
    rows = []
    for shape, (B, L) in (QUICK_SHAPES if args.quick else SHAPES).items():
        for compacted in (False, True):
            rows += bench_shape(shape, B, L, compacted, args.budget)
    H.add_speedups(rows, "op packed", "x_op", group="group")
    for r in rows:
        ad = next(x for x in rows if x["group"] == r["group"] and x["name"] == "adapter")
        r["peer_over_adapter"] = r["median_ms"] / ad["median_ms"]
    columns = [("op", "op", ""), ("shape", "shape", ""), ("name", "formulation", ""), ("median_ms", "median ms", ".3f"),
               ("min_ms", "min ms", ".3f"), ("peak_mib", "peak MiB", ".1f"), ("x_op", "x op", ".2f"),
               ("peer_over_adapter", "row/adapter", ".2f")]
    env = H.environment(torch.device("cpu"))
    notes = [f"{args.threads} thread(s); inputs float32; GAE gamma=1, lam=0.95, cross_segment='paper'",
             "peak MiB counts outputs and, for fwd+bwd rows, the gradient; [T] float32 = "
             f"{max(B * L for B, L in (QUICK_SHAPES if args.quick else SHAPES).values()) * 4 / 2**20:.0f} MiB",
             "peers treat every row as its own episode (no compacted rollouts); per-step GAE loops: 1-3 reps, "
             "no memory column"]
    H.report("trainer adapters (cpu)", rows, columns, env, notes, args.json)
    return rows


if __name__ == "__main__":
    main()
