# tfdist: two commands do all set-up on a fresh machine.
#   make demo   installs what it needs, then trains the main job (bundled dataset, offline)
#   make test   installs what it needs, then runs the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tfdist-installed

.PHONY: demo test unit install bench clean

install: $(STAMP)

# The stamp is newer than setup.cfg/pyproject.toml once the pinned set is in,
# so re-running make installs nothing.
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,test]'
	touch $@

demo: $(STAMP)
	$(BIN)/tfdist-train --flagfile=configs/demo.cfg

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests -m 'not integration'

clean:
	rm -rf $(VENV) build *.egg-info
