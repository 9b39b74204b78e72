"""Trainer adapters vs the ops on pre-packed data and vs peers' formulations, on padded [B, L] batches.

Each shape is a padded batch with ~30% observation tokens inside the responses and right padding; "compacted"
rows share rollout ids (2-3 rows per rollout, rows of one rollout scattered through the batch). Rows:
  op packed        the op on the batch already packed (padding removed, observation tokens kept, as `pack` does)
  adapter          the package's adapter (segment_gae_padded, verl `compaction` loss, OpenRLHF ValueLoss)
  adapter (pack)   the previous adapter path: packed_layout + pack/unpack around the op
  masked loop      the padded per-step reverse GAE loop of verl/OpenRLHF/TRL (restated:
                   compactionrl_fast/reference/gae.py masked_gae; verl 0.9 core_algos.compute_gae_advantage_return,
                   OpenRLHF 0.11 experience_maker get_advantages_and_returns, TRL 1.12 ppo_trainer), one segment per row
  naive masked     the plain torch masked clipped-PPO / value loss on [B, L] (verl 0.9 compute_policy_loss_vanilla +
                   agg_loss token-mean; OpenRLHF ValueLoss), forward + backward
"peer/adapter" is the peer row's time over the adapter's; "x op" is the op's time over the row's.

    python -m benchmarks.bench_adapters [--quick] [--threads 1] [--json PATH]
"""
from __future__ import annotations

import argparse

import torch

import compactionrl_fast as crf
from benchmarks import _harness as H
from compactionrl_fast.integrations import openrlhf, packed_layout, segment_gae_padded, verl
from compactionrl_fast.reference.gae import masked_gae

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


def _naive_policy_loss(logp, old, adv, mask, clip=0.2, dual=3.0):
    ratio = torch.exp(logp - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    l = torch.maximum(l1, l2)
    l = torch.where(adv < 0, torch.minimum(l, -adv * dual), l)
    return (l * mask).sum() / mask.sum()


def _naive_value_loss(v, old, ret, mask, clip=0.2):
    vc = old + (v - old).clamp(-clip, clip)
    l = 0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2)
    return (l * mask).sum() / mask.sum()


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
    if not compacted:
        rows.append(H.measure("masked loop", lambda: masked_gae(b["rew"], b["val"], b["mask"].float(), 1.0, 0.95),
                              config=cfg, budget_s=budget_s, min_reps=1, warmup=1, memory=False, nbytes=nbytes))

    cfg = dict(shape=tag, op="policy loss fwd+bwd")
    mask_f = b["mask"].float()
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

    def naive():
        x = b["logp"].clone().requires_grad_()
        _naive_policy_loss(x, b["old"], b["adv"], mask_f).backward()

    nbytes = 17 * T
    rows.append(H.measure("op packed", op_packed, config=cfg, budget_s=budget_s, nbytes=nbytes))
    rows.append(H.measure("adapter", adapter, config=cfg, budget_s=budget_s, nbytes=nbytes))
    rows.append(H.measure("naive masked", naive, config=cfg, budget_s=budget_s, nbytes=nbytes))

    cfg = dict(shape=tag, op="value loss fwd+bwd")
    vl = openrlhf.ValueLoss(0.2)

    def v_op_packed():
        x = lp_packed.clone().requires_grad_()
        loss, _ = crf.value_loss(x, old_p, adv_p, lay.loss_mask, clip=0.2)
        loss.backward()

    def v_adapter():
        x = b["logp"].clone().requires_grad_()
        vl(x, b["old"], b["adv"], b["mask"]).backward()

    def v_naive():
        x = b["logp"].clone().requires_grad_()
        _naive_value_loss(x, b["old"], b["adv"], mask_f).backward()

    rows.append(H.measure("op packed", v_op_packed, config=cfg, budget_s=budget_s, nbytes=nbytes))
    rows.append(H.measure("adapter", v_adapter, config=cfg, budget_s=budget_s, nbytes=nbytes))
    rows.append(H.measure("naive masked", v_naive, config=cfg, budget_s=budget_s, nbytes=nbytes))
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
             "'masked loop' only on one-row-per-rollout batches (it has no notion of compacted rollouts)"]
    H.report("trainer adapters (cpu)", rows, columns, env, notes, args.json)
    return rows


if __name__ == "__main__":
    main()
