# The README's two commands: `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Re-install only when the project's dependencies change (or the venv is missing).
STAMP  := $(VENV)/.tribucket-installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test venv bench gpu-check conformance clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo ">> installing $(TORCH_PIN) (CPU build) first, then tribucket[test,perf,trace,conformance,integrations,ft]"
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,perf,trace,conformance]'
	@# the real-model suite's libraries, after torch; naming $(TORCH_PIN) again in the same
	@# command makes pip keep it (a dependency asking for another torch fails the install)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[integrations]' $(TORCH_PIN)
	@# torchft (fault tolerance across replica groups, tests/test_ft.py), the same way
	$(PY) -m pip install -q --disable-pip-version-check -e '.[ft]' $(TORCH_PIN)
	@# the native gradient hooks, compiled now (once per machine, ~50 s on 2 cores) rather than
	@# in the background of the first demo or test run, where the compiler competes with the
	@# job for the CPUs; without a compiler the Python hooks are used (the same results)
	@echo ">> compiling tribucket's native gradient hooks (python -m tribucket.build)"
	@$(PY) -m tribucket.build --quiet || echo ">> not built; the Python hooks are used"
	@touch $(STAMP)

# The demo relaunches itself as .venv/bin/torchrun --standalone --nproc-per-node 2 (gloo on
# CPU) and prints that command; options pass through: make demo ARGS="--steps 300 --nproc 3".
demo: $(STAMP)
	$(PY) -m tribucket.demo $(ARGS)

# -p no:cacheprovider keeps a fresh clone clean; exit code 5 (no tests collected) fails the build.
test: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider $(ARGS)

bench: $(STAMP)
	$(PY) perf/bench_pack.py
	$(PY) perf/bench_step.py
	$(PY) perf/bench_moe.py

# Everything that needs a GPU (CUDA tests, pack benchmark with do_bench, NCCL step benchmark,
# kernel report) into perf/results/gpu/; refuses with the reason on a machine without one.
gpu-check: $(STAMP)
	$(PY) perf/gpu_check.py $(ARGS)

# torch's own DDP tests through tribucket.DistributedDataParallel, in torch's CPU configuration
# and with the GPU-gated tests run on the CPU; writes docs/conformance.md against DDP's recorded
# baseline (re-record it: make conformance ARGS="--impl ddp").
conformance: $(STAMP)
	$(PY) tests/conformance/run.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
