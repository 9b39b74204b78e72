"""GPU check of VLLMEngine (run where a GPU and vLLM are present; test_vllm.py calls it):

    python -m tests.rollout.vllm_gpu_check --workdir /tmp/crf_vllm

Saves a small random Llama for the memory task, then with vLLM in this process: runs compaction rollouts
and compares the sampled-token log-probs with a fresh float32 forward of the same weights on the packed
batch (prefix sharing on); loads new weights and checks generation follows them; sleeps and wakes.
Prints one JSON line and returns 0 when every check passes.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    from compactionrl_fast.envs import MemoryEnv, memory_config, memory_tokenizer, tiny_llama
    from compactionrl_fast.packing import pack
    from compactionrl_fast.rollout import VLLMEngine, run_rollouts

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--atol", type=float, default=2e-3, help="log-prob tolerance (vLLM kernels vs HF sdpa)")
    args = ap.parse_args(argv)
    tok = memory_tokenizer()
    # head_dim 64: the GPU attention backends do not all support the CPU demo's head_dim of 16
    model = tiny_llama(len(tok), d_model=256, heads=4, mlp=512, seed=0)
    model.save_pretrained(args.workdir)
    tok.save_pretrained(args.workdir)
    eng = VLLMEngine(args.workdir, dtype="float32", gpu_memory_utilization=0.25, max_model_len=512,
                     enforce_eager=True, skip_tokenizer_init=True, seed=0)
    report = {"device": torch.cuda.get_device_name(0)}

    cfg = memory_config(temperature=1.0, seed=1)
    ros = run_rollouts(eng, [MemoryEnv() for _ in range(args.rollouts)], tok, cfg)
    b = pack(ros, prefix_sharing=True, mask_errors=False)
    ref = fresh_logprobs(model.cuda(), b)
    m = b.loss_mask
    err = (ref[m] - b.rollout_logprobs[m]).abs().max().item() if bool(m.any()) else 0.0
    report.update(rollouts=len(ros), compactions=sum(r.compactions for r in ros), trainable=int(m.sum()),
                  logprob_max_abs_err=err)
    ok = err <= args.atol and report["compactions"] > 0

    other = tiny_llama(len(tok), d_model=256, heads=4, mlp=512, seed=1)
    eng.load_weights(other.state_dict())
    prompt = [tok.convert_tokens_to_ids(w) for w in "<system> memory <eos> <user> collect".split()]
    g = eng.generate([prompt], 8, temperature=0.0)[0]
    seq = torch.tensor(prompt + g.token_ids)[None].cuda()
    with torch.no_grad():
        lp = torch.log_softmax(other.cuda()(input_ids=seq).logits[0].float(), -1)
    want = lp[len(prompt) - 1:-1].argmax(-1).tolist()
    report["load_weights_greedy_match"] = want == g.token_ids
    ok &= want == g.token_ids

    eng.sleep()
    eng.wake()
    g2 = eng.generate([prompt], 8, temperature=0.0)[0]
    report["sleep_wake_same_output"] = g2.token_ids == g.token_ids
    ok &= g2.token_ids == g.token_ids
    report["ok"] = bool(ok)
    print(json.dumps(report))
    return 0 if ok else 1


@torch.no_grad()
def fresh_logprobs(model, batch):
    out = torch.zeros(batch.num_tokens)
    dev = next(model.parameters()).device
    for a0, a1 in zip(batch.cu_attn[:-1].tolist(), batch.cu_attn[1:].tolist()):
        ids = batch.input_ids[a0:a1].to(dev)
        logits = model(input_ids=ids[None]).logits[0].float()
        out[a0 + 1:a1] = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0].cpu()
    return out


if __name__ == "__main__":
    sys.exit(main())
