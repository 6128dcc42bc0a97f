# tfdist: two commands do all set-up on a fresh machine.
#   make demo   installs what it needs, then trains the main job (bundled dataset, offline)
#   make test   installs what it needs, then runs the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tfdist-installed
# keras-hub for the real-model tests, without its TensorFlow requirements
# (its imports are pinned in setup.cfg's test extra; BUILD_NOTES.md).
KERAS_HUB := keras-hub==0.32.0
# uv installs the pinned set in a fraction of pip's time (parallel downloads,
# its own cache); pip is the fallback where uv cannot reach its index.
# --compile-bytecode as pip does: without .pyc files (and with
# PYTHONDONTWRITEBYTECODE set, as on CI) every process compiles TensorFlow's
# Python again, 2.3 s of import becoming 5.1 s.
UV := uv==0.13.9

.PHONY: demo test slow unit doctest install horovod slurm bench clean iproute2 conformance audit \
	resume-matrix reference

install: $(STAMP)

# The stamp is newer than setup.cfg/pyproject.toml once the pinned set is in,
# so re-running make installs nothing.
$(STAMP): setup.cfg setup.py pyproject.toml Makefile
	@set -e; start=$$(date +%s); \
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
	if $(BIN)/python -m pip install --quiet --disable-pip-version-check $(UV) && \
	   $(BIN)/uv pip install --quiet --python $(BIN)/python --upgrade pip && \
	   $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[cpu,test]' && \
	   $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python --no-deps $(KERAS_HUB); then :; else \
	  echo "uv could not install the pinned set; installing with pip"; \
	  $(BIN)/python -m pip install --quiet --upgrade pip; \
	  $(BIN)/python -m pip install --quiet -e '.[cpu,test]'; \
	  $(BIN)/python -m pip install --quiet --no-deps $(KERAS_HUB); \
	fi; \
	echo $$(( $$(date +%s) - start )) > $(VENV)/.install-seconds; \
	touch $@

demo: $(STAMP)
	$(BIN)/tfdist-train --flagfile=configs/demo.cfg

# Horovod 0.28.1 built against the pinned TensorFlow (see BUILD_NOTES.md);
# the wheel is cached in ~/.cache/tfdist, so only the first build compiles.
# cmake and g++ come from Debian when missing (we run as root on CI).
horovod: $(STAMP)
	@command -v cmake >/dev/null && command -v g++ >/dev/null && command -v make >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ make; }
	launch/build_horovod.sh $(VENV)

# A one-node Slurm on this machine, to submit launch/slurm/tfdist.sbatch to:
# Debian's slurm-wlm and munge (installed when missing; root), started with its
# state in $TFDIST_SLURM_DIR (default /tmp/tfdist-slurm); it prints the
# SLURM_CONF to export. Stop it with `launch/slurm/local_slurm.sh stop`.
# tests/integration/test_slurm_runs.py starts (and stops) its own.
slurm:
	@launch/slurm/local_slurm.sh install
	@launch/slurm/local_slurm.sh start

# iproute2's `ip` and `tc` (network namespaces, veth links, tbf shaping) for the
# namespace tests and bench/slow_link.py, from Debian when missing (root);
# without them those skip, so a failed install only says so.
iproute2:
	@command -v ip >/dev/null && command -v tc >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; } || \
	  echo "iproute2 not installed: the namespace tests and bench/slow_link.py will skip"

# One pytest run, two xdist workers, with the Horovod build (2-4 minutes on
# a fresh 2-core machine, seconds once cached) beside it; the Horovod tests
# wait for it. Prints the slowest tests and each phase's time
# (tests/run_suite.sh). The build's log is $(VENV)/horovod-build.log.
test: $(STAMP) iproute2
	@tests/run_suite.sh $(VENV)

# The tests marked slow (pytest -m slow), which `make test` leaves out to keep
# its budget; CI runs both. What goes here (CONTRIBUTING.md, `make slow`):
# accuracy runs, XLA compiles, the transformer's sharded cases, the capped
# memory proofs, further cells of a matrix whose property `make test` proves
# on another engine or model, and end-to-end runs of what faster tests cover
# in one process (exposure probes, Slurm jobs, fuzzed, real-dataset and
# tfdist-compare runs).
slow: $(STAMP) iproute2
	@TFDIST_HOROVOD_VERIFY=0 $(MAKE) --no-print-directory horovod   # the tests run horovodrun
	TFDIST_REQUIRE_HOROVOD=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=10 \
	    -p no:cacheprovider -m slow \
	    --ignore=tests/docs tests

# Every ```sh and ```python block of README.md, CONTRIBUTING.md and docs/, run
# as written from a fresh directory per page, each tfdist-train command ending
# with --train_steps=2 (tests/docs/; blocks needing horovodrun, Slurm, two
# hosts, a GPU or root are skipped with their reason). Within 10 minutes on 2 cores.
doctest: $(STAMP)
	$(BIN)/python -m pytest -q -rs -n 2 --dist load --durations=10 -p no:cacheprovider tests/docs

# The unit tests alone (tests/unit/: one process, no training run; about 20 s here).
unit: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider tests/unit

# Every benchmark, one after the other; each prints its rows as it measures
# them and stays under ~10 minutes on a slow 2-core CPU (slow_link, ~19: two
# runs per row and rate, then a 400-step accuracy run per configuration). The
# sections collect in bench/results/report.md. A failed Horovod build only skips its bench.
bench: $(STAMP) iproute2
	$(BIN)/python bench/vs_fit.py
	$(BIN)/python bench/features.py
	$(BIN)/python bench/scaling.py
	-$(MAKE) --no-print-directory horovod
	$(BIN)/python bench/horovod_vs_multi_worker.py
	$(BIN)/python bench/allreduce.py
	$(BIN)/python bench/xla_cache.py
	$(BIN)/python bench/dtensor.py
	$(BIN)/python bench/depthwise.py
	$(BIN)/python bench/dtensor_init.py
	$(BIN)/python bench/input_order.py
	$(BIN)/python bench/parameter_server.py
	$(BIN)/python bench/staleness_sim.py
	$(BIN)/python bench/slow_link.py

# Every Keras 3 built-in layer with weights trained under dtensor on four meshes
# (and ZeRO-3) against the default engine, in one process (~15 minutes on 2 cores);
# writes the layer x mesh table to docs/dtensor_coverage.md.
audit: $(STAMP)
	$(BIN)/python conformance/dtensor_audit.py --out docs/dtensor_coverage.md

# Real users' models (keras-hub CausalLMs, BERT, ViT, keras.applications CNNs)
# x every engine, each cell checked against one device, exported and
# reloaded; writes docs/conformance.md (conformance/README.md: what it costs).
# Not part of `make test`.
conformance: $(STAMP)
	$(BIN)/python conformance/matrix.py --out docs/conformance.md

# A checkpoint written by each synchronous engine and size (one device,
# mirrored, multi_worker x2 and x4, horovod x2, dtensor 2x2 ZeRO-1 and ZeRO-3,
# pipeline across 2 processes) resumed under each, and the parameter server;
# writes docs/resume_matrix.md (~25 minutes on 2 cores). Not part of `make test`.
resume-matrix: $(STAMP)
	$(MAKE) --no-print-directory horovod
	$(BIN)/python conformance/resume_matrix.py --out docs/resume_matrix.md

# docs/reference/flags.md from the options' declarations (tfdist/config/) and
# the engines' records, README.md's engine table from the records, and
# docs/reference/cli.md and api.md from the programs' --help and the API's
# docstrings (tfdist/reference.py); tests/unit/test_options.py and
# test_reference.py fail when any is out of date.
reference: $(STAMP)
	$(BIN)/python -c "from tfdist import help; print(help.markdown_reference(), end='')" \
	    > docs/reference/flags.md
	$(BIN)/python -c "from tfdist import help; t = open('README.md').read(); \
	    open('README.md', 'w').write(help.with_engine_table(t))"
	$(BIN)/python -c "from tfdist import reference; print(reference.markdown_cli(), end='')" \
	    > docs/reference/cli.md
	$(BIN)/python -c "from tfdist import reference; print(reference.markdown_api(), end='')" \
	    > docs/reference/api.md

clean:
	rm -rf $(VENV) build *.egg-info
