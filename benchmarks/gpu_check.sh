#!/usr/bin/env bash
# One prepared, offline, time-boxed check for a lent GPU machine (at most GPU_CHECK_SECONDS, default 290 s).
#
#   bash benchmarks/gpu_check.sh                   # everything
#   bash benchmarks/gpu_check.sh --rerun-failed [PREV.json]
#                                                  # only what PREV failed (default: the last run's JSON, from
#                                                  # $OUT, build/gpu-check/last.json or benchmarks/results/
#                                                  # gpu_check.json: on a fresh machine, copy it there first)
#
# Needs only what the machine has: python3 with torch (a CUDA build), triton, pytest, nvcc; no network, nothing
# installed (the extension is built in place, so an externally-managed system Python is no obstacle).
# Stages, each with its own time limit and one line "PASS|FAIL|SKIP <stage> (<seconds> s) <note>":
#   probe        versions, the GPU (no GPU: every stage SKIPs, exit 2)
#   build        the CUDA extension for this GPU's architecture only (COMPACTIONRL_FAST_BUILD_CUDA=1,
#                CUDA_HOME exported when found), in the background while the Triton stages run
#   triton_tests tests/test_cuda_backends.py, Triton backends, compiled (TRITON_INTERPRET=0)
#   aot          tests/test_aot.py: sm_80/sm_90 compiles, spills, with this machine's nvcc (the Triton half only
#                when this machine's Triton is not one of the Makefile's AOT_TRITONS, which CI compiles with)
#   op_kernels   every op of torch.ops.compactionrl_fast has CPU, CUDA and Meta/fake kernels
#   cuda_tests   tests/test_cuda_backends.py, CUDA C++ backends          (SKIP when the build failed)
#   vllm         tests/rollout/vllm_gpu_check.py end to end             (SKIP when vllm is not installed)
#   gae_plans    bench_gae.py --gpu-plans: segment_gae's plans at 1M/16M tokens against the copy bandwidth
#   bench        python -m benchmarks --quick --no-loops --device cuda: every row with its share of the
#                measured copy bandwidth (python-loop baselines skipped: one launch per step on CUDA)
# Output folder: $OUT if set, else build/gpu-check: gpu_check.log (all of it), gpu_check.json (versions,
# device, stages, every test result, every benchmark row and the roofline), per-stage logs and JUnit XML.
# Exit 0 when every stage that ran passed, 1 when one failed, 2 without a GPU.
# GPU_CHECK_DRY_RUN=1 runs the same stages on CPU tensors (Triton interpreter, --device cpu benchmarks, a CUDA
# build where torch is a CUDA build and nvcc is there): how this script itself is checked without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT" build/gpu-check
OUT=$(cd "$OUT" && pwd)
DEADLINE=${GPU_CHECK_SECONDS:-290}
DRY=${GPU_CHECK_DRY_RUN:-0}
DEV=cuda INTERP=0 EXT_BACKEND=cuda
[ "$DRY" = 1 ] && { DEV=cpu INTERP=1 EXT_BACKEND=cpp; export CRF_KERNEL_TEST_DEVICE=cpu; }
RERUN=0 PREV=""
if [ "${1:-}" = "--rerun-failed" ]; then
  RERUN=1
  PREV=${2:-}
  for p in "$OUT/gpu_check.json" build/gpu-check/last.json benchmarks/results/gpu_check.json; do
    [ -z "$PREV" ] && [ -f "$p" ] && PREV=$p
  done
  [ -f "$PREV" ] || { echo "--rerun-failed: no earlier gpu_check.json found (give its path)"; exit 1; }
  cp "$PREV" "$OUT/previous.json" 2>/dev/null; PREV="$OUT/previous.json"
fi
exec > >(tee "$OUT/gpu_check.log") 2>&1
# Triton's compile cache lives in build/ (kept between calls on a warm machine); a full run starts it empty, as a
# fresh machine does, so that a dry run here costs the compiles a GPU machine pays
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/gpu-check/triton-cache}
[ $RERUN = 0 ] && rm -rf "$TRITON_CACHE_DIR"
: > "$OUT/stages.tsv"
status=0

left() { echo $(( DEADLINE - SECONDS )); }
budget() { local b=$1 l; l=$(( $(left) - 10 )); (( l < b )) && b=$l; (( b < 1 )) && b=1; echo "$b"; }
record() {  # stage status seconds note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/stages.tsv"
  printf '%-4s %-12s (%3s s) %s\n' "$2" "$1" "$3" "$4"
  [ "$2" = FAIL ] && status=1
}
# what a stage has to do: all, none, or a file of test ids (rerun of failed tests)
todo() {
  if [ $RERUN = 0 ]; then echo all; return; fi
  local w; w=$($PY benchmarks/gpu_check_lib.py failed "$PREV" "$1")
  case "$w" in all|none) echo "$w" ;; *) echo "$w" > "$OUT/$1.ids"; echo "$OUT/$1.ids" ;; esac
}
# run_pytest STAGE LIMIT TARGET... : pytest with JUnit XML, one PASS/FAIL line
run_pytest() {
  local stage=$1 lim=$2 t0=$SECONDS rc; shift 2
  local what; what=$(todo "$stage")
  if [ "$what" = none ]; then record "$stage" SKIP 0 "passed last time"; return; fi
  local targets=("$@"); [ "$what" != all ] && mapfile -t targets < "$what"
  timeout -k 5 "$lim" $PY -m pytest -q -p no:cacheprovider -rfEx --junitxml="$OUT/$stage.xml" "${targets[@]}" \
    > "$OUT/$stage.log" 2>&1
  rc=$?
  local summary; summary=$(grep -E "(passed|failed|error|skipped|xfailed|deselected|no tests ran).* in [0-9.]+s" "$OUT/$stage.log" | tail -n 1)
  if [ $rc = 0 ] || [ $rc = 5 ]; then record "$stage" PASS $((SECONDS - t0)) "$summary"
  elif [ $rc = 124 ] || [ $rc = 137 ]; then record "$stage" FAIL $((SECONDS - t0)) "timeout after ${lim} s"
  else record "$stage" FAIL $((SECONDS - t0)) "$summary (log: $stage.log)"; grep -E "^(FAILED|ERROR)" "$OUT/$stage.log" | head -n 20
  fi
}
finish() {
  $PY benchmarks/gpu_check_lib.py report "$OUT" ${PREV:+"$PREV"} || echo "could not write gpu_check.json"
  cp "$OUT/gpu_check.json" build/gpu-check/last.json 2>/dev/null
  echo "results: $OUT/gpu_check.json (log: $OUT/gpu_check.log)"
  echo "gpu_check: $1 in $SECONDS s"
  exit "$2"
}

echo "==== gpu_check $( [ $RERUN = 1 ] && echo "--rerun-failed $PREV") (limit ${DEADLINE} s)"
# the Triton kernels are installed as compactionrl_fast.kernels; a source tree needs the link (git ignores it)
[ -e compactionrl_fast/kernels ] || ln -s ../kernels compactionrl_fast/kernels

t0=$SECONDS
if timeout -k 5 "$(budget 60)" $PY benchmarks/gpu_check_lib.py probe "$OUT/probe.json"; then
  record probe PASS $((SECONDS - t0)) ""
else
  rc=$?
  if [ $rc = 3 ] && [ "$DRY" = 1 ]; then
    record probe PASS $((SECONDS - t0)) "dry run on CPU"
  elif [ $rc = 3 ]; then
    echo "no GPU: $($PY -c "import json; print(json.load(open('$OUT/probe.json'))['no_gpu_reason'])" 2>/dev/null)"
    record probe SKIP $((SECONDS - t0)) "no GPU"
    for s in build triton_tests aot op_kernels cuda_tests vllm bench gae_plans; do record $s SKIP 0 "no GPU"; done
    finish "SKIP (no GPU)" 2
  else
    record probe FAIL $((SECONDS - t0)) "torch/CUDA probe failed (exit $rc)"
    finish FAIL 1
  fi
fi
ARCH=$($PY -c "import json; g = json.load(open('$OUT/probe.json'))['gpus']; print(g[0]['sm'] if g else '9.0')")

# ---- build (background) while the Triton stages run
CUDA_HOME_FOUND=$(COMPACTIONRL_FAST_BUILD_CUDA=auto $PY benchmarks/gpu_check_lib.py cuda-home 2> "$OUT/cuda_home.log")
if [ -n "$CUDA_HOME_FOUND" ]; then export CUDA_HOME=$CUDA_HOME_FOUND; echo "CUDA_HOME=$CUDA_HOME"; fi
have_cuda_ext() { $PY -c "import compactionrl_fast._C as c, sys; sys.exit(c.WITH_CUDA != 1)" 2>/dev/null; }
need_build=all
if [ $RERUN = 1 ]; then
  need_build=$(todo build)
  for s in op_kernels cuda_tests; do [ "$(todo $s)" != none ] && ! have_cuda_ext && need_build=all; done
fi
build_pid=""
if [ "$need_build" != none ]; then
  rm -rf build/gpu-check/lib
  build_t0=$SECONDS
  ( COMPACTIONRL_FAST_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" \
      timeout -k 5 "$(budget 170)" $PY setup.py build_ext --build-lib build/gpu-check/lib --build-temp build/gpu-check/tmp \
      > "$OUT/build.log" 2>&1 ) &
  build_pid=$!
else
  record build SKIP 0 "passed last time"
fi

# ---- Triton stages (need no build)
CRF_KERNEL_TEST_BACKENDS=triton TRITON_INTERPRET=$INTERP run_pytest triton_tests "$(budget 110)" tests/test_cuda_backends.py
TV=$($PY -c "import triton; print(triton.__version__)" 2>/dev/null)
AOT=(tests/test_aot.py)
if [ -n "$TV" ] && grep -qE "^AOT_TRITONS *=.*( |=)${TV//./\\.}( |$)" Makefile; then
  AOT+=(-k cuda_kernels); echo "aot: CI compiles the Triton kernels with triton $TV (make aot-tritons): nvcc only here"
fi
TRITON_INTERPRET=0 CRF_KERNEL_TEST_DEVICE= run_pytest aot "$(budget 50)" "${AOT[@]}"

build_ok=1
if [ -n "$build_pid" ]; then
  wait "$build_pid"; rc=$?
  so=$(ls build/gpu-check/lib/compactionrl_fast/_C*.so 2>/dev/null | head -n 1)
  if [ $rc = 0 ] && [ -n "$so" ]; then
    cp "$so" compactionrl_fast/
    record build PASS $((SECONDS - build_t0)) "sm_${ARCH/./}, $(grep -m1 'compactionrl-fast setup: building' "$OUT/build.log" | cut -c1-150)"
  else
    build_ok=0
    note=$([ $rc = 124 ] && echo "timeout" || grep -m1 -E "error|compactionrl-fast setup: (COMPACT|no CUDA|torch)" "$OUT/build.log" | cut -c1-200)
    [ -z "$note" ] && note=$(tail -n 1 "$OUT/build.log" | cut -c1-200)
    record build FAIL $((SECONDS - build_t0)) "$note (log: build.log)"
    tail -n 15 "$OUT/build.log"
  fi
fi

# ---- stages that need the CUDA extension
if [ $build_ok = 1 ]; then
  t0=$SECONDS
  if [ "$(todo op_kernels)" = none ]; then record op_kernels SKIP 0 "passed last time"
  elif timeout -k 5 "$(budget 40)" $PY benchmarks/op_kernels.py --require-cuda --json "$OUT/op_kernels.json" > "$OUT/op_kernels.log" 2>&1; then
    record op_kernels PASS $((SECONDS - t0)) "$(tail -n 1 "$OUT/op_kernels.log")"
  else
    record op_kernels FAIL $((SECONDS - t0)) "$(grep -m3 MISSING "$OUT/op_kernels.log" | tr '\n' ';')"; cat "$OUT/op_kernels.log"
  fi
  CRF_KERNEL_TEST_BACKENDS=$EXT_BACKEND TRITON_INTERPRET=$INTERP run_pytest cuda_tests "$(budget 60)" tests/test_cuda_backends.py
else
  record op_kernels SKIP 0 "after a failed build"
  record cuda_tests SKIP 0 "after a failed build"
fi

# ---- vLLM end to end, where it is installed
t0=$SECONDS
if ! $PY -c "import vllm" > /dev/null 2>&1; then record vllm SKIP 0 "vllm is not installed"
elif [ "$(todo vllm)" = none ]; then record vllm SKIP 0 "passed last time"
elif timeout -k 5 "$(budget 120)" $PY -m tests.rollout.vllm_gpu_check --workdir build/gpu-check/vllm --rollouts 8 \
       > "$OUT/vllm.log" 2>&1; then record vllm PASS $((SECONDS - t0)) "$(tail -n 1 "$OUT/vllm.log" | cut -c1-200)"
else record vllm FAIL $((SECONDS - t0)) "(log: vllm.log)"; tail -n 10 "$OUT/vllm.log"
fi

# ---- segment_gae plans: default vs single-pass look-back at 1M and 16M tokens against the copy bandwidth
t0=$SECONDS
lim=$(budget 60)
if [ "$(todo gae_plans)" = none ]; then record gae_plans SKIP 0 "passed last time"
elif [ "$DEV" != cuda ]; then record gae_plans SKIP 0 "needs a GPU"
elif [ "$lim" -lt 15 ]; then record gae_plans FAIL 0 "no time left (${lim} s)"
elif TRITON_INTERPRET=0 timeout -k 5 "$lim" $PY benchmarks/bench_gae.py --device cuda --gpu-plans --budget 0.1 \
       --json "$OUT/gae_plans.json" > "$OUT/gae_plans.log" 2>&1; then
  record gae_plans PASS $((SECONDS - t0)) "(table: gae_plans.log)"
  grep -aE "lookback|triton  |copy" "$OUT/gae_plans.log" | head -n 40
else
  record gae_plans FAIL $((SECONDS - t0)) "(log: gae_plans.log)"; tail -n 15 "$OUT/gae_plans.log"
fi

# ---- benchmarks: quick sizes, no python-loop baselines
t0=$SECONDS
lim=$(budget 90)
if [ "$(todo bench)" = none ]; then record bench SKIP 0 "passed last time"
elif [ "$lim" -lt 20 ]; then record bench FAIL 0 "no time left (${lim} s)"
elif TRITON_INTERPRET=0 timeout -k 5 "$lim" $PY -m benchmarks --quick --no-loops --device $DEV --budget 0.1 \
       --timeout $(( lim / 3 )) --no-charts --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1; then
  record bench PASS $((SECONDS - t0)) "$(grep -a -m1 '^roofline' "$OUT/bench.log")"
else
  record bench FAIL $((SECONDS - t0)) "$(grep -aE '^FAILED|timed out' "$OUT/bench.log" | head -n 3 | tr '\n' ';') (log: bench.log)"
fi
[ "$(todo bench)" != none ] && [ -f "$OUT/bench.log" ] && sed -n '/^roofline/,/^wrote/p' "$OUT/bench.log" | head -n 60

[ $status = 0 ] && finish PASS 0 || finish FAIL 1
