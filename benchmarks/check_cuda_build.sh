#!/usr/bin/env bash
# `make check-cuda-build`: the CUDA build as a GPU user makes it, checked on any machine with nvcc (no GPU needed).
#
# 1. build/cuda-venv: the CUDA torch wheel from the index (about 5 GB; the spec excludes the +cpu build a
#    local wheel folder may offer), its own triton, and the test dependencies at constraints.txt's versions;
# 2. a copy of this checkout in build/cuda-src, built there with `COMPACTIONRL_FAST_BUILD_CUDA=1 pip install
#    --no-build-isolation -e .` for sm_80 and sm_90, without CUDA_HOME (setup.py must find the toolkit);
# 3. imports it (WITH_CUDA must be 1) and lists every op of torch.ops.compactionrl_fast with its CPU, CUDA
#    and Meta kernels and its Python fake implementation; a missing one is reported by name and fails;
# 4. runs the CPU test suite in that environment (CUDA_VISIBLE_DEVICES= : the GPU tests skip).
# Every step runs even when an earlier check failed; the last line says PASS or FAIL. Log: build/cuda-check.log.
#
# Variables: PYTHON (python3), TORCH_SPEC (torch==2.13.0,!=2.13.0+cpu), ARCHS ("8.0;9.0"), MAX_JOBS (2), PYTEST_ARGS (-q).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0,!=2.13.0+cpu}
ARCHS=${ARCHS:-8.0;9.0}
VENV=$ROOT/build/cuda-venv
SRC=$ROOT/build/cuda-src
mkdir -p build
exec > >(tee build/cuda-check.log) 2>&1
fail=()
step() { echo; echo "==> [$SECONDS s] $*"; }

step "disk"
free_gb=$(df -Pk build | awk 'NR==2 {print int($4 / 1048576)}')
echo "${free_gb} GB free under build/"
if [ ! -x "$VENV/bin/python" ] && [ "$free_gb" -lt 8 ]; then
  echo "FAIL: the CUDA torch wheel and its libraries need about 6 GB; free some space"; exit 1
fi

step "1. $VENV: $TORCH_SPEC (CUDA wheel from the index) and the test dependencies"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV" || exit 1
# constraints.txt pins the CPU stack's triton; the CUDA torch wheel pins its own
grep -v '^triton==' constraints.txt > build/cuda-constraints.txt
"$VENV/bin/python" -m pip install --upgrade pip || exit 1
"$VENV/bin/python" -m pip install -c build/cuda-constraints.txt "$TORCH_SPEC" \
  numpy pytest pytest-benchmark transformers tokenizers tqdm pyyaml matplotlib ninja || exit 1
"$VENV/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| triton', triton.__version__)"
"$VENV/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)" || { echo "FAIL: $TORCH_SPEC is not a CUDA build"; exit 1; }

step "2. build with CUDA (TORCH_CUDA_ARCH_LIST=$ARCHS, CUDA_HOME unset: setup.py finds the toolkit)"
rm -rf "$SRC" && mkdir -p "$SRC"
git ls-files -z -co --exclude-standard | grep -zv '^compactionrl_fast/kernels$' | tar --null -T - -cf - | tar -xf - -C "$SRC"
ln -sfn ../kernels "$SRC/compactionrl_fast/kernels"
which nvcc && nvcc --version | tail -n 2
if (cd "$SRC" && env -u CUDA_HOME -u CUDA_PATH COMPACTIONRL_FAST_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCHS" \
      MAX_JOBS="${MAX_JOBS:-2}" "$VENV/bin/python" -m pip install -v --no-deps --no-build-isolation -e . 2>&1 |
    sed -unE -e '/compactionrl-fast setup|[Ee]rror|warning|Successfully installed/p' \
            -e 's#^(\[[0-9]+/[0-9]+\]) .* -c (/[^ ]+\.(cpp|cu)) .*#\1 \2#p'; exit "${PIPESTATUS[0]}"); then
  echo "PASS build"
else
  echo "FAIL build"; fail+=(build)
fi

step "3. import, and the kernels of every op"
if (cd "$SRC" && CUDA_VISIBLE_DEVICES= "$VENV/bin/python" "$ROOT/benchmarks/op_kernels.py" --require-cuda); then
  echo "PASS import and op kernels"
else
  echo "FAIL import or op kernels (see above)"; fail+=(ops)
fi

step "4. the CPU test suite in this environment"
if (cd "$SRC" && CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest ${PYTEST_ARGS:--q} -p no:cacheprovider); then
  echo "PASS tests"
else
  echo "FAIL tests"; fail+=(tests)
fi

step "done"
if [ ${#fail[@]} -eq 0 ]; then echo "check-cuda-build: PASS"; else echo "check-cuda-build: FAIL (${fail[*]})"; exit 1; fi
