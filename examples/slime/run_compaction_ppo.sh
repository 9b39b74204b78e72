#!/bin/bash
# CompactionRL (the paper's recipe) with slime on one 8-GPU node: PPO with the critic, compaction rollouts
# through slime's SGLang router, compute_advantages for the cross-segment GAE. Not run by this project (it needs
# a GPU cluster); docs/slime.md says what was tested on CPU. Set the paths below, then run it as it is.
#
# Needs: slime (THUDM/slime at 624b824 or later) and its Megatron-LM, SGLang, this package
# (pip install compactionrl-fast, or -e of this repository) in the same Python environment on every node.
set -ex
export PYTHONUNBUFFERED=1

SLIME_DIR=${SLIME_DIR:-/root/slime}                      # EDIT: slime checkout
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}           # EDIT: Megatron-LM checkout slime uses
HF_CKPT=${HF_CKPT:-/root/models/Qwen3-4B}                 # EDIT: the policy (and critic) checkpoint
REF_LOAD=${REF_LOAD:-/root/Qwen3-4B_torch_dist}           # EDIT: its Megatron torch_dist conversion
SAVE_DIR=${SAVE_DIR:-/root/Qwen3-4B_compaction}           # EDIT: where checkpoints go
PROMPT_DATA=${PROMPT_DATA:-/root/data/tasks.jsonl}        # EDIT: one task per line (make_env reads the Sample)
NUM_GPUS=${NUM_GPUS:-8}
HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"

source "${SLIME_DIR}/scripts/models/qwen3-4B.sh"         # EDIT: MODEL_ARGS of your model

CKPT_ARGS=(--hf-checkpoint "${HF_CKPT}" --ref-load "${REF_LOAD}" --load "${SAVE_DIR}" --save "${SAVE_DIR}"
           --save-interval 20)

ROLLOUT_ARGS=(
   --prompt-data "${PROMPT_DATA}" --input-key prompt --label-key label --rollout-shuffle
   --num-rollout 1000
   --rollout-batch-size 128 --n-samples-per-prompt 1      # 128 rollouts per step, group size 1
   --global-batch-size 128                                # rollouts per training step
   --rollout-max-response-len 10240 --rollout-max-context-len 65536
   --rollout-temperature 1.0
   --custom-generate-function-path compactionrl_fast.integrations.slime.generate
)

PPO_ARGS=(
   --advantage-estimator ppo                              # the critic (use_critic)
   --custom-advantage-function-path compactionrl_fast.integrations.slime.compute_advantages
   --custom-config-path "${HERE}/compaction.yaml"         # compaction_* options
   --megatron-config-path "${HERE}/megatron_roles.yaml"   # actor lr 2e-6, critic lr 3e-6
   --num-critic-only-steps 50                             # value pre-training
   --gamma 1.0
   --kl-coef 0.0
   --eps-clip 0.2 --eps-clip-high 0.28
   --calculate-per-token-loss                             # token-level loss over the global batch
)

OPTIMIZER_ARGS=(--optimizer adam --lr 2e-6 --lr-decay-style constant --weight-decay 0.1
                --adam-beta1 0.9 --adam-beta2 0.98)

PERF_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
           --context-parallel-size 2 --recompute-granularity full --recompute-method uniform
           --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 16384)

SGLANG_ARGS=(--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7)

MISC_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
           --attention-softmax-in-fp32 --attention-backend flash --colocate
           --actor-num-nodes 1 --actor-num-gpus-per-node "${NUM_GPUS}")

export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus "${NUM_GPUS}" --disable-usage-stats

RUNTIME_ENV_JSON="{\"env_vars\": {\"PYTHONPATH\": \"${MEGATRON_DIR}:${HERE}\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\"}}"

ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 "${SLIME_DIR}/train.py" \
   "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
   "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}"
