#!/usr/bin/env bash
# One prepared check for a lent GPU machine; fits in 10 minutes (one device command).
#
#   bash benchmarks/gpu_check.sh
#
# 1. prints the GPU, driver, nvcc, torch and triton versions;
# 2. builds the CUDA extension for this GPU's architecture
#    (COMPACTIONRL_FAST_BUILD_CUDA=1 pip install --no-deps --no-build-isolation -e .);
# 3. runs the kernel tests on the GPU with the Triton kernels compiled (TRITON_INTERPRET=0):
#    tests/test_cuda_backends.py (every op's triton/cuda backend vs the float64 references) and
#    tests/test_aot.py (sm_80/sm_90 compiles, register/spill report, with this machine's nvcc);
# 4. runs the full benchmark suite on the GPU: the copy bandwidth and the bf16 matmul rate are measured
#    first and every row is reported as a fraction of them (python -m benchmarks --full --device cuda).
#
# Results go to $OUT (the device tool's output folder) or benchmarks/results: the suite JSON, its log,
# one chart per benchmark, and gpu_check.log with everything printed here (at most 8 files). Back on the
# development machine: copy the suite files into benchmarks/results/ and run `python -m benchmarks.report`.
# Each step has a time limit derived from GPU_CHECK_SECONDS (default 570) so the whole run ends in time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
DEADLINE=${GPU_CHECK_SECONDS:-570}
status=0
exec > >(tee "$LOG") 2>&1

left() { echo $(( DEADLINE - SECONDS )); }
step() { echo; echo "==== [$SECONDS s] $*"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || status=1
nvcc --version | tail -n 2 || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, \
'|', torch.cuda.get_device_name(0), 'sm_%d%d' % torch.cuda.get_device_capability())" || { echo "no usable GPU"; exit 1; }
ARCH=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")

step "build the CUDA extension (TORCH_CUDA_ARCH_LIST=$ARCH)"
if ! COMPACTIONRL_FAST_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" \
     timeout 240 $PY -m pip install -q --no-deps --no-build-isolation -e . ; then
  echo "BUILD FAILED"; exit 1
fi
$PY -c "import torch, compactionrl_fast as c; print('backends on cuda:', c.available_backends(torch.device('cuda')))"

step "kernel tests on the GPU"
if ! TRITON_INTERPRET=0 timeout $(( $(left) > 400 ? 180 : $(left) / 3 )) \
     $PY -m pytest -q -p no:cacheprovider tests/test_cuda_backends.py tests/test_aot.py -rs; then
  echo "KERNEL TESTS FAILED"; status=1
fi

step "benchmark suite with roofline (python -m benchmarks --full --device cuda)"
n=$(ls benchmarks/bench_*.py | wc -l)
per=$(( ($(left) - 40) / (n > 0 ? n : 1) ))
(( per < 30 )) && per=30
stamp=$(date -u +%Y%m%d-%H%M%S)
if ! TRITON_INTERPRET=0 $PY -m benchmarks --full --device cuda --budget 0.3 --timeout "$per" \
     --json "$OUT/suite-cuda-full-$stamp.json"; then
  echo "SOME BENCHMARKS FAILED (see the suite log)"; status=1
fi

step "done in $SECONDS s, status $status"
ls -la "$OUT"
exit $status
