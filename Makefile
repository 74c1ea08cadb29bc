# Two entry points, both safe on a fresh machine: they install what is missing first.
#   make demo   build a 4-member demo pool, mount it, write and read through it, measure
#   make test   run the test suite (real FUSE mounts: needs root and /dev/fuse), and beside
#               it the engine tests (vLLM, SGLang, LMCache) in their own virtualenv
#   make test-fast  the units and a few smoke mounts, in about a minute: between edits
#   make lint   ruff and mypy
VENV ?= .venv
PY := $(VENV)/bin/python
ENGINES ?= .venv-engines

.PHONY: demo test test-fast test-engines install engines lint lint-engines bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tools/install.sh tools/checkout_path.sh
	bash tools/install.sh $(VENV)
	touch $@

engines: $(ENGINES)/.installed

$(ENGINES)/.installed: pyproject.toml tools/install_engines.sh tools/engines-constraints.txt \
		$(VENV)/.installed
	bash tools/install_engines.sh $(ENGINES)
	touch $@

demo: install
	$(VENV)/bin/mxfs demo

# Every layer; the engines' virtualenv is made and checked, and their tests run, while
# the main suite runs (tools/run_tests.sh prints the times).
test: install
	bash tools/run_tests.sh $(VENV) $(ENGINES)

test-fast: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m "(unit or smoke) and not pg"

# The engines' own classes drive the adapters and the loader; here nothing may skip.
test-engines: engines lint-engines
	MXFS_REQUIRE_ENGINES=1 $(ENGINES)/bin/python -m pytest -q -m engines -n 2 --dist loadfile

# mypy's files and settings: [tool.mypy] in pyproject.toml (its cache: .mypy_cache)
lint: install
	$(VENV)/bin/ruff check mxfs tools tests
	$(VENV)/bin/mypy

# The adapters type-checked against the engines' real classes (in their virtualenv).
lint-engines: engines
	$(ENGINES)/bin/python -m mypy --config-file tools/mypy-engines.ini mxfs/kv/adapters \
		mxfs/load/vllm_plugin.py

bench: install
	$(PY) tools/bench_fs.py

clean:
	rm -rf $(VENV) $(ENGINES) build *.egg-info
