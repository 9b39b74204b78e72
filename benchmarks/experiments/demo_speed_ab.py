"""Where `make demo`'s time can be won: measurement-only A/B experiments at 1 thread (issue 41).

    python benchmarks/experiments/demo_speed_ab.py [--sft-steps 30] [--rl-steps 3] [--reps 5] [--only split,compile,mm,mul,gen] [--mallopt]
    MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/experiments/demo_speed_ab.py

Nothing here changes the package: every alternative is built beside the demo's own code and timed against it
in the same process, round-robin (A, B, A, B, ...), medians reported with the load average. Setup: the demo's
config at 1 thread, `--sft-steps` SFT steps (so rollouts have the demo's lengths), then the experiments:

  split    SFT step = expert rollouts | pack | update; PPO step = rollouts | micro-batches | train_step, with
           1 PPO epoch (demo steps < 40) and 3 (steps >= 40, two thirds of the run); and one actor update of a
           real mini-batch split into forward | backward | optimizer.
  compile  torch.compile (inductor, dynamic=True) of the actor's decoder in the padded training forward +
           backward on the PPO mini-batches (varying [rows, width]): first-call (compile) time, recompiles,
           time per forward+backward after warm-up vs eager, max |diff| of loss and grads.
  mm       the model's matmul shapes ([T, 64] x [64, out], decode [B, 64]; backward's [out, T] x [T, 64]):
           F.linear (MKL sgemm) vs oneDNN (mkldnn._linear_pointwise) vs torch.mm on W.t(); and q/k/v (3 x 64)
           or gate/up (2 x 256) as one fused matmul, forward + backward.
  mul      aten::mul calls of one decoder forward + backward grouped by input shape (which module makes them),
           and F.rms_norm vs the HF RMSNorm, one SiLU-gate formulation vs another (forward + backward).
  gen      the embedded engine's cost per generated token for the SFT policy's rollouts at the demo's temperature
           and at a higher one (longer, more compacted rollouts: a proxy for the ablation's), and one decode step's
           time vs batch rows (the straggler tail of a generate call).
  fb       (only when named) eager forward + backward of the PPO mini-batches, one median per process, and its
           minor page faults: for the allocator A/B between processes (commands in the results file).

`--compile-backend aot_eager` runs the compile experiment without code generation; `--mallopt` fixes glibc's
malloc thresholds at start (both for narrowing down, see the results file).

Prints markdown tables (benchmarks/results/demo-speed-experiments.md holds a run's output).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def ab(fns: dict, reps: int, inner: int = 1) -> dict:
    """Median seconds per call of each fn, timed round-robin `reps` times (each time `inner` calls)."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - t) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def md(rows, head) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- setup

def setup(a):
    from compactionrl_fast.app.demo import demo_config
    from compactionrl_fast.app.runner import build, run_sft, task
    from compactionrl_fast.train.config_load import update

    d = tempfile.mkdtemp()
    cfg = demo_config(threads=1, run_dir=d, progress=False, steps=a.rl_steps, value_pretrain_steps=0)
    tok, make_envs, rcfg = task(cfg)
    actor = build(cfg, tok)
    t = time.perf_counter()
    run_sft(update(cfg, {"sft.steps": a.sft_steps}), actor, tok, make_envs, rcfg, progress=False)
    print(f"setup: {a.sft_steps} SFT steps in {time.perf_counter() - t:.1f} s, load {load()}")
    return cfg, tok, make_envs, rcfg, actor


def rl_batches(cfg, tok, make_envs, rcfg, actor, steps):
    """`steps` PPO steps' rollouts (the demo's seeds), packed as fit packs them: [(rollouts, batches, minibatches)]."""
    from compactionrl_fast.app.runner import packer
    from compactionrl_fast.train.engines import make_engine
    from compactionrl_fast.train.loop import _rollouts_fn, micro_batches, train_seeds

    engine = make_engine(cfg, actor, tok)
    out = []
    for it in range(steps):
        r = rcfg.replace(temperature=cfg.temperature, seed=(cfg.seed * 100_003 + it) * 1009)
        ro = _rollouts_fn(engine)(engine, make_envs(cfg.rollouts_per_step), tok, r,
                                  train_seeds(cfg, it, 0, cfg.rollouts_per_step))
        b, mb = micro_batches(ro, cfg, packer(cfg), "cpu")
        out.append((ro, b, mb))
    return out


def ppo_step_data(sft_steps: int):
    """The A/B scripts' common start at 1 thread: after `sft_steps` SFT steps, 2 PPO steps' batches with every
    update at the demo's 3 epochs -> (cfg, data as rl_batches gives it, actor, critic)."""
    from compactionrl_fast.train.config_load import update
    from compactionrl_fast.train.model import critic_from_actor

    torch.set_num_threads(1)
    cfg, tok, make_envs, rcfg, actor = setup(argparse.Namespace(sft_steps=sft_steps, rl_steps=2))
    cfg = update(cfg, {"ppo_epochs_from": 0})
    return cfg, rl_batches(cfg, tok, make_envs, rcfg, actor, 2), actor, critic_from_actor(actor)


def padded(m):
    """The padded forward's inputs of micro-batch m, as packed_hidden builds them: [(ids, mask, pos, seq, col, tok)]."""
    b = m.batch
    out = []
    for seq, col, tk, mask, *_ in m.tables:  # the full forward (keep/slot of the positions unused)
        A, L = mask.shape
        ids = b.input_ids.new_zeros(A, L).index_put_((seq, col), b.input_ids[tk])
        pos = b.position_ids.new_zeros(A, L).index_put_((seq, col), b.position_ids[tk])
        out.append((ids, mask, pos, seq, col, tk))
    return out


def nll(actor, dec, m, ins):
    """Token-sum NLL of m's trainable tokens through `dec` (the actor's decoder, or a compiled one) + the LM head."""
    T = m.batch.input_ids.numel()
    hidden = None
    for ids, mask, pos, seq, col, tk in ins:
        h = dec(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state[seq, col]
        hidden = (h.new_zeros(T, h.shape[-1]) if hidden is None else hidden).index_copy(0, tk, h)
    logits = actor.lm_head(hidden[m.idx - 1])
    return -torch.log_softmax(logits, -1).gather(1, m.batch.input_ids[m.idx][:, None]).sum()


# ----------------------------------------------------------------------------------------------- 1. split

def exp_split(a, cfg, tok, make_envs, rcfg, actor, data):
    from compactionrl_fast.app.runner import SFT_SEED_BASE, packer
    from compactionrl_fast.envs.memory import ScriptedExpert
    from compactionrl_fast.rollout.loop import run_rollouts
    from compactionrl_fast.train import sft
    from compactionrl_fast.train.config_load import update
    from compactionrl_fast.train.engines import make_engine
    from compactionrl_fast.train.loop import _rollouts_fn, micro_batches, split_rollouts, train_seeds
    from compactionrl_fast.train.model import actor_logprobs, critic_from_actor
    from compactionrl_fast.train.trainer import make_state, train_step

    print(f"\n## 1. Split of a step (1 thread, load {load()})\n")
    s = cfg.sft
    sactor = copy.deepcopy(actor)
    opt = sft.make_optimizer(sactor, s)
    pack = packer(cfg)
    expert = ScriptedExpert(s.expert_drop_p, seed=cfg.seed * 1009)
    parts = {"rollouts": [], "pack": [], "update": []}
    for step in range(a.reps + 1):
        t0 = time.perf_counter()
        seeds = [SFT_SEED_BASE + (cfg.seed * 100_003 + 500 + step) * 16 + i for i in range(s.rollouts_per_step)]
        demos = run_rollouts(expert, make_envs(s.rollouts_per_step), tok, rcfg, seeds)
        t1 = time.perf_counter()
        batches = [pack(g) for g in split_rollouts(demos, cfg.micro_batch_tokens)]
        t2 = time.perf_counter()
        sft.sft_step(sactor, opt, batches, s, lr=1e-4)
        t3 = time.perf_counter()
        if step:  # the first is warm-up
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v)
    med = {k: statistics.median(v) for k, v in parts.items()}
    tot = sum(med.values())
    rows = [[f"SFT ({s.rollouts_per_step} expert rollouts)", *(f"{med[k] * 1e3:.0f} ({med[k] / tot:.0%})" for k in parts),
             f"{tot * 1e3:.0f}"]]
    # PPO: fresh state from the SFT actor; alternate 1 and 3 epochs (ppo_epochs_from 0 = the demo's steps >= 40)
    pactor = copy.deepcopy(actor)
    state = make_state(cfg, pactor, critic_from_actor(pactor))
    engine = make_engine(cfg, pactor, tok)
    cfgs = {1: update(cfg, {"ppo_epochs_from": 10 ** 6}), cfg.ppo_epochs: update(cfg, {"ppo_epochs_from": 0})}
    ppo = {e: {"rollouts": [], "micro-batches": [], "train_step": []} for e in cfgs}
    for it in range(2 * a.rl_steps):
        e = list(cfgs)[it % 2]
        state.cfg = cfgs[e]
        state.step = it
        t0 = time.perf_counter()
        r = rcfg.replace(temperature=cfg.temperature, seed=(cfg.seed * 100_003 + it) * 1009)
        ro = _rollouts_fn(engine)(engine, make_envs(cfg.rollouts_per_step), tok, r,
                                  train_seeds(cfg, it, 0, cfg.rollouts_per_step))
        t1 = time.perf_counter()
        b, mb = micro_batches(ro, state.cfg, pack, "cpu")
        t2 = time.perf_counter()
        train_step(state, b, update_actor=True, advantage_gap=False, minibatches=mb, measure_sampler_gap=False)
        t3 = time.perf_counter()
        for k, v in zip(ppo[e], (t1 - t0, t2 - t1, t3 - t2)):
            ppo[e][k].append(v)
    for e, p in ppo.items():
        med = {k: statistics.median(v) for k, v in p.items()}
        tot = sum(med.values())
        rows.append([f"PPO, {e} epoch(s) ({cfg.rollouts_per_step} rollouts, {cfg.ppo_minibatches} mini-batches)",
                     *(f"{med[k] * 1e3:.0f} ({med[k] / tot:.0%})" for k in p), f"{tot * 1e3:.0f}"])
    print(md(rows, ["step", "generation", "pack / micro-batches", "update", "total ms"]))
    # one actor mini-batch update, split
    _, batches, mbs = data[0]
    m = batches[mbs[0][0]]
    opt = torch.optim.Adam(pactor.parameters(), lr=1e-7)
    fw, bw, op = [], [], []
    for _ in range(a.reps + 1):
        t0 = time.perf_counter()
        loss = -actor_logprobs(pactor, m.batch, m.idx, tables=m.tables).sum() / m.idx.numel()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(pactor.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        fw.append(t1 - t0), bw.append(t2 - t1), op.append(t3 - t2)
    f, b_, o = (statistics.median(x[1:]) for x in (fw, bw, op))
    shapes = ", ".join(f"{tuple(t[3].shape)}" for t in m.tables)
    print(f"\nOne actor mini-batch (T={m.batch.input_ids.numel()} tokens, N={m.idx.numel()} trainable; padded buckets "
          f"[rows, width]: {shapes}): forward {f * 1e3:.0f} ms, backward {b_ * 1e3:.0f} ms, clip + Adam {o * 1e3:.1f} ms "
          f"(load {load()})")


# ----------------------------------------------------------------------------------------------- fb

def exp_fb(a, actor, data):
    """Forward + backward of the PPO mini-batches, eager: one number per process, for A/B between processes
    (allocator settings, CPU capability) run alternately by a shell loop."""
    ms = [b[i] for _, b, mb in data for g in mb for i in g]
    ins = [padded(m) for m in ms]
    model = copy.deepcopy(actor)
    dec = model.get_decoder()

    def run():
        for m, x in zip(ms, ins):
            model.zero_grad(set_to_none=True)
            nll(model, dec, m, x).backward()

    import resource

    run()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    r = ab({"fb": run}, a.reps)["fb"]
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / a.reps
    print(f"fb: {len(ms)} mini-batches forward + backward {r * 1e3:.0f} ms (median of {a.reps}), "
          f"{faults:.0f} minor page faults per pass, "
          f"malloc env {os.environ.get('GLIBC_TUNABLES', '-')}, mallopt {a.mallopt}, "
          f"preload {os.path.basename(os.environ.get('LD_PRELOAD', '-'))}, "
          f"load {load()}")


# ----------------------------------------------------------------------------------------------- 2. compile

def exp_compile(a, cfg, actor, data):
    print(f"\n## 2. torch.compile of the decoder's training forward + backward ({a.compile_backend}, dynamic=True; "
          f"load {load()})\n")
    ms = [b[i] for _, b, mb in data for g in mb for i in g]
    ins = [padded(m) for m in ms]
    eager = copy.deepcopy(actor)
    comp = copy.deepcopy(actor)
    cdec = torch.compile(comp.get_decoder(), dynamic=True, backend=a.compile_backend)
    edec = eager.get_decoder()
    import torch._dynamo.utils as du

    def run(model, dec, i):
        model.zero_grad(set_to_none=True)
        loss = nll(model, dec, ms[i], ins[i])
        loss.backward()
        return loss

    first = []
    for i in range(len(ms)):  # every shape once: compiles (and recompiles) happen here
        t = time.perf_counter()
        run(comp, cdec, i)
        first.append(time.perf_counter() - t)
    frames = du.counters["stats"].get("unique_graphs", "?")
    diffs_l, diffs_g = [], []
    for i in range(len(ms)):
        le, lc = float(run(eager, edec, i).detach()), float(run(comp, cdec, i).detach())
        if not (math.isfinite(le) and math.isfinite(lc)):
            print(f"mini-batch {i}: non-finite loss, eager {le}, compiled {lc}")
        diffs_l.append(abs(le - lc) / max(abs(le), 1e-30))
        for (name, pe), pc in zip(eager.named_parameters(), comp.parameters()):
            if pe.grad is None:
                continue
            if not (bool(pe.grad.isfinite().all()) and bool(pc.grad.isfinite().all())):
                print(f"mini-batch {i}: non-finite grad of {name}: eager {bool(pe.grad.isfinite().all())}, "
                      f"compiled {bool(pc.grad.isfinite().all())}")
            diffs_g.append(float((pe.grad - pc.grad).abs().max() / pe.grad.abs().max().clamp_min(1e-30)))
    t_e, t_c = [], []
    for _ in range(a.reps):
        for i in range(len(ms)):
            r = ab({"e": lambda: run(eager, edec, i), "c": lambda: run(comp, cdec, i)}, 1)
            t_e.append(r["e"]), t_c.append(r["c"])
    shapes = sorted({tuple(x[1].shape) for b in ins for x in b})
    worst = lambda xs: max(xs, key=lambda v: (v != v, v))  # noqa: E731  (NaN counts as the worst)
    print(md([[len(ms), f"{first[0]:.1f} s", f"{max(first[1:], default=0):.1f} s", frames,
               f"{statistics.median(t_e) * 1e3:.0f}", f"{statistics.median(t_c) * 1e3:.0f}",
               f"{statistics.median(t_e) / statistics.median(t_c):.2f}", f"{worst(diffs_l):.1e}", f"{worst(diffs_g):.1e}"]],
             ["mini-batches", "first call (compile)", "slowest later first call (recompile)", "unique graphs",
              "eager fwd+bwd ms (median)", "compiled ms", "speed-up", "max rel |loss diff|",
              "max |grad diff| / max |grad| (per tensor)"]))
    print(f"\npadded shapes [rows, width] seen: {shapes}; load {load()}")


# ----------------------------------------------------------------------------------------------- 3. mm

def exp_mm(a, data):
    print(f"\n## 3. The model's matmuls: MKL (F.linear) vs oneDNN vs torch.mm, fused vs split (load {load()})\n")
    # the largest bucket of each mini-batch holds most of its tokens: its rows x width
    T = int(statistics.median([max(x[1].numel() for x in padded(b[i])) for _, b, mb in data for g in mb for i in g]))
    g = torch.Generator().manual_seed(0)
    rows = []
    have_dnn = hasattr(torch.ops.mkldnn, "_linear_pointwise")
    for n_tok in (T, 64, 8):
        for k, n in ((64, 64), (64, 192), (64, 256), (64, 512), (256, 64)):
            x = torch.randn(n_tok, k, generator=g)
            w = torch.randn(n, k, generator=g)
            gy = torch.randn(n_tok, n, generator=g)
            fns = {"F.linear": lambda: F.linear(x, w), "mm(x, W.t())": lambda: torch.mm(x, w.t())}
            if have_dnn:
                fns["oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
            fns["bwd dX = dY W"] = lambda: torch.mm(gy, w)
            fns["bwd dW = dY^T X"] = lambda: torch.mm(gy.t(), x)
            inner = max(1, int(2e7 / (n_tok * k * n)))
            r = ab(fns, a.reps * 3, inner)
            if have_dnn:
                ok = float((fns["oneDNN"]() - fns["F.linear"]()).abs().max())
            rows.append([f"[{n_tok}, {k}] x [{k}, {n}]", *(f"{v * 1e6:.1f}" for v in r.values()),
                         f"{2 * n_tok * k * n / r['F.linear'] / 1e9:.1f}"] + ([f"{ok:.0e}"] if have_dnn else []))
    head = ["shape", "F.linear us", "mm(x, W.t()) us"] + (["oneDNN us"] if have_dnn else []) + \
        ["bwd dX us", "bwd dW us", "F.linear GFLOP/s"] + (["oneDNN max abs diff"] if have_dnn else [])
    print(md(rows, head))
    # fused vs split, forward + backward with autograd, at the training token count
    rows = []
    for name, k, outs in (("q, k, v", 64, (64, 64, 64)), ("gate, up", 64, (256, 256))):
        x = torch.randn(T, k, generator=g, requires_grad=True)
        ws = [torch.randn(n, k, generator=g, requires_grad=True) for n in outs]
        wf = torch.cat([w.detach() for w in ws]).requires_grad_()
        gys = [torch.randn(T, n, generator=g) for n in outs]
        gyf = torch.cat(gys, 1)

        def split():
            ys = [F.linear(x, w) for w in ws]
            torch.autograd.backward(ys, gys)

        def fused():
            y = F.linear(x, wf)
            y.split(list(outs), 1)  # what the model would do with it
            y.backward(gyf)

        r = ab({"split": split, "fused": fused}, a.reps * 3, 3)
        rows.append([name, f"[{T}, {k}] x {len(outs)} x [{k}, {outs[0]}]", f"{r['split'] * 1e3:.2f}",
                     f"{r['fused'] * 1e3:.2f}", f"{r['split'] / r['fused']:.2f}"])
    print()
    print(md(rows, ["projections", "shape", "split fwd+bwd ms", "fused fwd+bwd ms", "speed-up"]))
    print(f"\nT = {T}: the median over mini-batches of the largest padded bucket's rows x width; load {load()}")


# ----------------------------------------------------------------------------------------------- 4. mul

def exp_mul(a, actor, data):
    from torch.profiler import ProfilerActivity, profile

    print(f"\n## 4. Elementwise muls: where they come from, fused formulations (load {load()})\n")
    _, b, mb = data[0]
    m = b[mb[0][0]]
    ins = padded(m)
    model = copy.deepcopy(actor)
    dec = model.get_decoder()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model.zero_grad(set_to_none=True)
        nll(model, dec, m, ins).backward()
    ev = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mul"]
    tot = sum(e.self_cpu_time_total for e in ev)
    ev.sort(key=lambda e: -e.self_cpu_time_total)
    rows = [[str(e.input_shapes)[:70], e.count, f"{e.self_cpu_time_total / 1e3:.1f}",
             f"{e.self_cpu_time_total / tot:.0%}"] for e in ev[:10]]
    allt = sum(e.self_cpu_time_total for e in prof.key_averages())
    print(md(rows, ["aten::mul input shapes", "calls", "self ms", "share of mul"]))
    print(f"\naten::mul: {tot / 1e3:.1f} ms of {allt / 1e3:.1f} ms self CPU in one forward + backward "
          f"(buckets {[tuple(x[1].shape) for x in ins]})")
    # fused alternatives on the first bucket's shape
    A, L = ins[0][1].shape
    g = torch.Generator().manual_seed(0)
    norm = dec.layers[0].input_layernorm
    x = torch.randn(A, L, 64, generator=g, requires_grad=True)
    gy = torch.randn(A, L, 64, generator=g)
    w = norm.weight.detach().clone().requires_grad_()
    eps = norm.variance_epsilon

    def hf():
        torch.autograd.backward(norm(x), gy)

    def fused():
        torch.autograd.backward(F.rms_norm(x, (64,), w, eps), gy)

    mlp = dec.layers[0].mlp
    gt = torch.randn(A, L, 256, generator=g, requires_grad=True)
    up = torch.randn(A, L, 256, generator=g, requires_grad=True)
    g2 = torch.randn(A, L, 256, generator=g)

    def silu_mul():
        torch.autograd.backward(mlp.act_fn(gt) * up, g2)

    def sig_mul():  # silu(g) * u as g * sigmoid(g) * u: what a fused kernel computes, in eager ops
        torch.autograd.backward(gt * torch.sigmoid(gt) * up, g2)

    cos = torch.randn(A, 1, L, 32, generator=g)
    sin = torch.randn(A, 1, L, 32, generator=g)
    q = torch.randn(A, 2, L, 32, generator=g, requires_grad=True)
    gq = torch.randn(A, 2, L, 32, generator=g)

    def rot_hf():
        h = q.shape[-1] // 2
        torch.autograd.backward(q * cos + torch.cat((-q[..., h:], q[..., :h]), -1) * sin, gq)

    def rot_addcmul():  # same products, one fused multiply-add for the second (same rounding per element? no: fma)
        h = q.shape[-1] // 2
        torch.autograd.backward(torch.addcmul(q * cos, torch.cat((-q[..., h:], q[..., :h]), -1), sin), gq)

    r = ab({"hf": hf, "fused": fused, "silu_mul": silu_mul, "sig_mul": sig_mul, "rot_hf": rot_hf,
            "rot_addcmul": rot_addcmul}, a.reps * 3, 3)
    with torch.no_grad():
        d_norm = float((norm(x) - F.rms_norm(x, (64,), w, eps)).abs().max())
    rows = [["RMSNorm (HF: pow, mean, rsqrt, 2 mul)", "F.rms_norm", f"{r['hf'] * 1e3:.2f}", f"{r['fused'] * 1e3:.2f}",
             f"{r['hf'] / r['fused']:.2f}", f"{d_norm:.1e}"],
            ["SiLU gate: act(g) * u", "g * sigmoid(g) * u", f"{r['silu_mul'] * 1e3:.2f}", f"{r['sig_mul'] * 1e3:.2f}",
             f"{r['silu_mul'] / r['sig_mul']:.2f}", "-"],
            ["rotary: q cos + rot(q) sin", "addcmul", f"{r['rot_hf'] * 1e3:.2f}", f"{r['rot_addcmul'] * 1e3:.2f}",
             f"{r['rot_hf'] / r['rot_addcmul']:.2f}", "-"]]
    print()
    print(md(rows, ["piece (as the model runs it)", "alternative", "now fwd+bwd ms", "alt ms", "speed-up",
                    "max abs diff"]))
    print(f"\nshapes: [{A}, {L}, 64] (norm), [{A}, {L}, 256] (MLP), [{A}, 2, {L}, 32] (rotary, one of q/k); load {load()}")


# ----------------------------------------------------------------------------------------------- 5. gen

def exp_gen(a, cfg, tok, make_envs, rcfg, actor):
    from compactionrl_fast.rollout.engines import lean_decoder
    from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine
    from compactionrl_fast.rollout.loop import run_rollouts
    from compactionrl_fast.train.loop import train_seeds

    print(f"\n## 5. Generation cost per token: the demo's rollouts vs longer ones (load {load()})\n")
    rows = []
    for temp in (cfg.temperature, 1.5 * cfg.temperature):
        eng = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
        calls = []
        orig = eng.generate

        def gen(prompts, max_new, **kw):
            t = time.perf_counter()
            out = orig(prompts, max_new, **kw)
            calls.append((time.perf_counter() - t, len(prompts), sum(len(o.token_ids) for o in out),
                          max(len(o.token_ids) for o in out)))
            return out

        eng.generate = gen
        per = []
        for rep in range(a.rl_steps):
            calls.clear()
            t = time.perf_counter()
            ro = run_rollouts(eng, make_envs(cfg.rollouts_per_step), tok, rcfg.replace(temperature=temp, seed=rep),
                              train_seeds(cfg, 1000 + rep, 0, cfg.rollouts_per_step))
            wall = time.perf_counter() - t
            gen_s = sum(c[0] for c in calls)
            new = sum(c[2] for c in calls)
            toks = sum(sum(len(s) for s in r.segments) for r in ro)
            comp = statistics.mean(r.compactions for r in ro)
            steps = sum(c[3] for c in calls)  # decode steps (each call runs as long as its longest row)
            per.append((wall, gen_s, len(calls), new, toks, comp, steps))
        wall, gen_s, n, new, toks, comp, steps = (statistics.median(x) for x in zip(*per))
        rows.append([f"{temp:g}", f"{wall:.2f}", f"{gen_s:.2f}", n, f"{new / cfg.rollouts_per_step:.0f}",
                     f"{toks / cfg.rollouts_per_step:.0f}", f"{comp:.2f}", f"{steps:.0f}",
                     f"{gen_s / new * 1e6:.0f}", f"{gen_s / steps * 1e3:.2f}"])
    print(md(rows, ["temperature", "rollouts wall s", "in generate s", "generate calls", "generated tokens / rollout",
                    "trained tokens / rollout", "compactions / rollout", "decode steps", "us per generated token",
                    "ms per decode step"]))
    # one decode step vs batch rows at a context of 128 (the compaction budget)
    rows = []
    actor.eval()
    with torch.no_grad():
        for B in (64, 32, 16, 8, 4, 1):
            cache = lean_decoder.KVCache(actor, B, 160)
            ids = torch.randint(3, len(tok), (B, 128))
            pos = torch.arange(128).expand(B, 128)
            lean_decoder.forward(actor, ids, torch.ones(B, 128, dtype=torch.long), pos, cache, True)
            mask = torch.ones(B, 129, dtype=torch.long)
            one, p1 = ids[:, -1:], torch.full((B, 1), 128)

            def step():
                cache.length = 128
                lean_decoder.forward(actor, one, mask, p1, cache, False)

            r = ab({"s": step}, a.reps * 3, 5)["s"]
            rows.append([B, f"{r * 1e3:.2f}", f"{r / B * 1e6:.0f}"])
    actor.train()
    print()
    print(md(rows, ["rows", "ms per decode step (context 128)", "us per row"]))
    print(f"\nload {load()}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--rl-steps", type=int, default=3, help="PPO steps per setting in split; rollout batches elsewhere")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", default="split,compile,mm,mul,gen", help="comma-separated; also: fb")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile experiment")
    p.add_argument("--mallopt", action="store_true",
                   help="glibc mallopt at start: no mmap for blocks < 256 MiB, no heap trim < 1 GiB (allocator A/B)")
    a = p.parse_args(argv)
    if a.mallopt:  # M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3 (malloc.h); fixed values stop glibc's own tuning
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(-1, 1 << 30) == 1 and libc.mallopt(-3, 1 << 28) == 1
    torch.set_num_threads(1)
    env = {k: os.environ.get(k) for k in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
    print(f"torch {torch.__version__}, 1 thread, {env}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"load {load()}")
    only = set(a.only.split(","))
    cfg, tok, make_envs, rcfg, actor = setup(a)
    data = rl_batches(cfg, tok, make_envs, rcfg, actor, 2) if only & {"split", "compile", "mm", "mul", "fb"} else None
    t0 = time.perf_counter()
    if "split" in only:
        exp_split(a, cfg, tok, make_envs, rcfg, actor, data)
    if "mm" in only:
        exp_mm(a, data)
    if "mul" in only:
        exp_mul(a, actor, data)
    if "gen" in only:
        exp_gen(a, cfg, tok, make_envs, rcfg, actor)
    if "fb" in only:
        exp_fb(a, actor, data)
    if "compile" in only:  # last: its compiled graphs stay in the process
        exp_compile(a, cfg, actor, data)
    print(f"\nexperiments {time.perf_counter() - t0:.0f} s, load {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
