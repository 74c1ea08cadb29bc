# Two entry points, both safe on a fresh machine: they install what is missing first.
#   make demo   build a 4-member demo pool, mount it, write and read through it, measure
#   make test   run the test suite (real FUSE mounts: needs root and /dev/fuse)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test install lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tools/install.sh
	bash tools/install.sh $(VENV)
	touch $@

demo: install
	$(VENV)/bin/mxfs demo

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check mxfs tools tests

bench: install
	$(PY) tools/bench_fs.py

clean:
	rm -rf $(VENV) build *.egg-info
