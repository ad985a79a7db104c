# Two commands from a fresh clone (Python 3.10-3.12 is all it needs):
#   make up     set up .venv if needed, then serve the demo model (Redis + worker + gateway)
#   make test   set up .venv with the dev extra if needed, then run the tests but the slow tier
#   make test-all   the same, every test (what CI runs)
# Set-up is scripts/bootstrap.sh: torch for this machine (TORCH_INDEX=<url> to choose), the project,
# and a stamp so a second run with an unchanged pyproject.toml installs nothing.

VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: up test test-all clean

up:
	@VENV=$(VENV) scripts/bootstrap.sh run
	$(VENV)/bin/pagedserve serve $(ARGS)

# -n auto: one test process per core (tests/conftest.py gives each one compute thread); a test
# file stays in one process, so its module fixtures are built once.
PYTEST_PARALLEL ?= -n auto --dist loadfile

test:
	@VENV=$(VENV) scripts/bootstrap.sh dev
	$(VENV)/bin/python -m pytest $(PYTEST_PARALLEL) -m "not slow" $(PYTEST_ARGS)

test-all:
	@VENV=$(VENV) scripts/bootstrap.sh dev
	$(VENV)/bin/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
