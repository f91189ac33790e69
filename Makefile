# `make demo` and `make test` each build .venv on first use (torch pinned to 2.13.0; pip's
# find-links on these machines serve its CPU wheel from /opt/wheels).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench bench-load bench-gpu bench-scale clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# torchtitan 0.3.0 (tests/integrations/test_torchtitan.py) without its declared dependencies:
	# it asks for datasets<4.8 (the dev extra pins 5.2.0 for transformers/TRL) and wandb, none of
	# which its checkpointer imports; what it does import is in the dev extra.
	$(BIN)/python -m pip install --quiet --no-deps "torchtitan==0.3.0"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/run_demo.py

test: $(STAMP)
	$(BIN)/ruff check src tests examples bench
	$(MKDOCS)
	# Two workers, each test file on one of them (module fixtures built once): most of the
	# suite waits on real processes, timeouts and servers, so 2 workers fit 2 cores (20-24 min measured on 2-core VMs).
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link, anchor or API reference.
# Offline: no fonts, no CDN. Output in build/site.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
docs: $(STAMP)
	$(MKDOCS)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench

bench: $(STAMP)
	$(BIN)/python bench/bench_save.py

bench-load: $(STAMP)
	$(BIN)/python bench/bench_load.py

bench-scale: $(STAMP)
	$(BIN)/python bench/bench_scale.py

bench-gpu: $(STAMP)
	$(BIN)/python bench/bench_gpu.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
