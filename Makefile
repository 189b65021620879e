# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs docs-serve test-latest-clis system-deps agent-clis bench clean

# proctor's own bytecode, written by compileall whatever PYTHONDONTWRITEBYTECODE says: an editable install
# compiles nothing, and where that variable is set (as on this project's machines) every `proctor` process
# compiled its ~230 modules afresh: 0.49 s an import against 0.31 s (measured 2026-12-07). Only stale files
# are rewritten, so `make test` runs it again after an edit.
COMPILE = $(PY) -m compileall -q src

# pip is quiet (its ~300 lines buried the demo's one answer, issue 43); the line before it says how long it
# takes, so the minute is not read as a hang (issue 24).
$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing proctor with its test dependencies (once; about a minute)"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --progress-bar off -e '.[test]'
	$(PY) scripts/warm-pytest-cache.py
	$(COMPILE)
	touch $(STAMP)
	@echo "make: installed into $(VENV)"

demo: $(STAMP)
	$(PY) scripts/demo.py

# The documentation site, built offline into site/ (--strict: a broken link or a missing example fails it;
# tests/test_docs.py builds it too). `make docs-serve` serves it at http://127.0.0.1:8000 while you edit.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "make: the site is in site/ (open site/index.html)"

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# Debian packages the tests use for real (git, bubblewrap, sqlite3); installed only where missing.
system-deps:
	bash scripts/install-system-deps.sh

# The real agent CLIs from npm, cached outside the repo; test_real_clis.py checks our argv against them.
agent-clis:
	bash scripts/install-agent-clis.sh

# The suite spreads over the cores with pytest-xdist (PYTEST_N=auto; PYTEST_N=0 runs it in one process). A
# whole run from a fresh clone under /tmp: 1,606 tests, 11.4 min in all on 2 cores, CI=true.
# Tests marked `serial` run after the rest, alone. The 25 slowest are listed at the end: where the time goes.
PYTEST_N ?= auto

test: $(STAMP) system-deps agent-clis
	$(COMPILE)
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_N) --dist loadgroup -m "not serial" --durations=25
	$(PY) -m pytest -q -p no:cacheprovider -m serial

# On demand, never in CI: the real-CLI tests against the registry's newest release of each CLI, in a cache of
# their own. A failure names what changed; a pass, with the new version added to the adapter's `tested`
# (test_the_installed_cli_is_a_tested_version says which), is a version proctor was tested with.
LATEST_CLIS ?= $(HOME)/.cache/proctor/agent-clis-latest

test-latest-clis: $(STAMP) system-deps
	PROCTOR_CLI_CACHE=$(LATEST_CLIS) bash scripts/install-agent-clis.sh --latest
	PROCTOR_CLI_CACHE=$(LATEST_CLIS) PROCTOR_CLI_LATEST=1 CI=true $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_N) \
		--dist loadgroup -m realcli

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
