# Two commands from a fresh clone: `make demo` runs the main job, `make test` the tests.
# Both create .venv on first use; torch==2.13.0 resolves to the CPU build on CPU machines.
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: demo test gpu-check bench setup deepspeed-setup results results-full

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/zeropp demo

test: setup
	$(PYTHON) -m pytest -q

# The CUDA path on a machine with a GPU (NCCL, gloo with CUDA tensors, parity, kernels);
# the quantization figures land in benchmarks/results/gpu/. Needs a CUDA build of torch.
gpu-check: setup
	$(PYTHON) -m pytest -q -m gpu -s tests/test_gpu.py

bench: setup
	$(VENV)/bin/zeropp bench comm
	$(VENV)/bin/zeropp bench quant
	$(VENV)/bin/zeropp bench grad-error
	$(PYTHON) benchmarks/bench_fsdp2.py

# DeepSpeed for the side-by-side throughput benchmark only: a separate environment, never a
# dependency of zeropp. DS_BUILD_OPS=0 skips its CUDA extensions; zeropp itself is installed
# without dependencies so the benchmark script can import the same GPT and corpus.
DEEPSPEED_VENV := .venv-deepspeed

$(DEEPSPEED_VENV)/.installed:
	python3 -m venv $(DEEPSPEED_VENV)
	$(DEEPSPEED_VENV)/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	$(DEEPSPEED_VENV)/bin/python -m pip install --quiet torch==2.13.0 numpy tqdm safetensors
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(DEEPSPEED_VENV)/bin/python -m pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(DEEPSPEED_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

deepspeed-setup: $(DEEPSPEED_VENV)/.installed

# Every figure of the README and docs/results at one clean commit (root; docs/results/README.md):
# the quick tier (about 40 minutes on 2 cores) or the full one (hours; rerun with --resume),
# then the figure blocks rewritten from the stored JSON. A dirty tree is refused.
results: setup deepspeed-setup
	$(VENV)/bin/zeropp results run --tier quick
	$(VENV)/bin/zeropp results render

results-full: setup deepspeed-setup
	$(VENV)/bin/zeropp results run --tier full
	$(VENV)/bin/zeropp results render
