"""The last decoder layer at the heads' positions only, A/B at 1 thread (issue 41).

    OMP_NUM_THREADS=1 python benchmarks/experiments/last_layer_ab.py [--sft-steps 30] [--reps 3]

The actor's log-probs and the critic's values read the decoder's output at N of T positions (the states
before trainable tokens: 2027 of 12264 on the demo's first PPO mini-batch). `packed_hidden(positions=...)`
runs the last layer's residual MLP and the final norm only there (its attention still runs everywhere: the
keys and values of every position feed it). Here, on the demo's PPO step (real batches of 2 steps after a
short SFT, every update with the demo's 3 epochs, `train_step` as the trainer runs it, fresh copies of the
actor and critic each call, variants round-robin, medians), the step with it against the full forward then
the selection (what packed_hidden did before); also the largest difference of the hidden states between the
two on the first micro-batches (float32 rounding: the MLP's matmuls see fewer rows).

Third variant, "all queries": the positions' forward with the last layer's queries and attention on every
position (tables without qcol, as packed_hidden ran from ad6e6cc until its queries were selected too).
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
from compactionrl_fast.train import trainer as TR  # noqa: E402
from compactionrl_fast.train.trainer import make_state, train_step  # noqa: E402


def full_actor_logprobs(actor, batch, idx, *, temperature=1.0, return_entropy=False, tables=None):
    """actor_logprobs through the full forward, then the selection."""
    from compactionrl_fast.ops import linear_logprobs

    hidden = M.packed_hidden(actor, batch.input_ids, batch.position_ids, batch.cu_attn, tables=tables)[idx - 1]
    head = actor.get_output_embeddings()
    return linear_logprobs(hidden, head.weight, batch.input_ids[idx], bias=head.bias, temperature=temperature,
                           return_entropy=return_entropy)


def full_critic_hidden(critic, batch, idx, tables=None):
    return M.packed_hidden(critic, batch.input_ids, batch.position_ids, batch.cu_attn, tables=tables)[idx - 1]


def _all_queries(tables):
    return [b._replace(qcol=None, qflat=None) for b in tables]


def all_queries_actor_logprobs(actor, batch, idx, *, tables=None, **kw):
    return M.actor_logprobs(actor, batch, idx, tables=_all_queries(tables), **kw)


def all_queries_critic_hidden(critic, batch, idx, tables=None):
    return M.critic_hidden(critic, batch, idx, tables=_all_queries(tables))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    cfg, data, actor, critic = ppo_step_data(a.sft_steps)
    mbs = [m for _, b, _ in data for m in b]
    diff = 0.0
    with torch.no_grad():
        for m in mbs[:2]:
            b = m.batch
            full = M.packed_hidden(actor, b.input_ids, b.position_ids, b.cu_attn, tables=m.tables)[m.idx - 1]
            at = M.packed_hidden(actor, b.input_ids, b.position_ids, b.cu_attn, positions=m.idx - 1, tables=m.tables)
            diff = max(diff, float((full - at).abs().max()))
    variants = {"full forward": (full_actor_logprobs, full_critic_hidden),
                "all queries": (all_queries_actor_logprobs, all_queries_critic_hidden),
                "at positions": (TR.actor_logprobs, TR.critic_hidden)}

    def run(k):
        TR.actor_logprobs, TR.critic_hidden = variants[k]
        st = make_state(cfg, copy.deepcopy(actor), copy.deepcopy(critic))
        t = time.perf_counter()
        for _, b, mb in data:
            train_step(st, b, minibatches=mb, diagnose=False)
        TR.actor_logprobs, TR.critic_hidden = variants["at positions"]
        return time.perf_counter() - t

    times = {k: [] for k in variants}
    for _ in range(a.reps):
        for k in variants:
            times[k].append(run(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(m.idx.numel() for m in mbs)
    T = sum(m.batch.input_ids.numel() for m in mbs)
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    print(f"{isa}: 2 PPO steps (3 epochs), median of {a.reps}: full forward {med['full forward']:.2f} s, "
          f"all queries {med['all queries']:.2f} s, at positions {med['at positions']:.2f} s "
          f"({med['full forward'] / med['at positions']:.3f}x the full forward, "
          f"{med['all queries'] / med['at positions']:.3f}x all queries); "
          f"N / T = {n} / {T}; hidden states' largest difference {diff:.1e}; load {load()}")


if __name__ == "__main__":
    main()
