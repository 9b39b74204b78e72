# Everything runs inside .venv (made by `make install`).
PY ?= .venv/bin/python
PIP_DEPS = torch==2.13.0 triton numpy pytest pytest-benchmark transformers tokenizers tqdm pyyaml matplotlib ninja cmake

.PHONY: install build test test-fast ctest bench demo clean

install:            ## venv, dependencies, and the C++ extension
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_DEPS)
	$(PY) -m pip install -q --no-build-isolation -e .

build:              ## rebuild the extension in place after editing csrc/
	$(PY) setup.py build_ext --inplace -q

test:               ## the whole test suite (CPU; Triton kernels under the interpreter; AOT compiles)
	$(PY) -m pytest -q

ctest:              ## the C++ tests through CMake
	cmake -S . -B build/cmake -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
	cmake --build build/cmake -j2
	ctest --test-dir build/cmake --output-on-failure

bench:              ## every op's benchmark against its reference, table + JSON in benchmarks/results/
	$(PY) -m benchmarks

demo:               ## the CPU demo: SFT, CompactionRL, ablation, plots
	$(PY) -m compactionrl_fast demo

clean:
	rm -rf build *.egg-info compactionrl_fast/*.so
