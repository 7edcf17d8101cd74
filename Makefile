# Every target builds .venv itself from pyproject.toml (a fresh clone needs nothing else).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo agent-demo test lint bench faults slow fuzz mutants clean venv web browser pooler pythons lowest

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH"; exit 2; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,web,agents,mcp-clients]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/sagaworker demo

# the example's trip-booking agent (tasks/agent.py, Pydantic AI) as a durable flow on the same
# embedded defaults (a worker killed mid-run, a gate with no process, a declined card): a
# scripted model, offline, unless SAGAWORKER_AGENT_MODEL names a real one (e.g.
# openai:gpt-4.1-mini, with OPENAI_API_KEY set)
agent-demo: $(STAMP)
	$(BIN)/sagaworker demo --agent

lint: $(STAMP)
	$(BIN)/ruff check sagaworker tasks config tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

# the unit tests on the other Pythons pyproject claims (.venv-3.12, .venv-3.13); a missing
# interpreter is skipped, except with CI=true (the machine image has them: .ci/pythons.sh)
pythons:
	bash .ci/pythons.sh 3.12 3.13

# the unit tests with the lowest versions pyproject's ranges allow (.venv-lowest, on $(PY))
lowest:
	PY=$(PY) bash .ci/lowest.sh

faults: $(STAMP)
	FAULT_SCALE=large $(BIN)/pytest tests/faults

# the slow tests make test runs on one broker (marked one_broker), on both
slow: $(STAMP)
	SAGAWORKER_TEST_BOTH_BROKERS=1 $(BIN)/pytest -m one_broker

# the state machine's model checker with a long random budget (make test runs a fixed one);
# a failure reports at once (no shrinking), a pass takes minutes: past the usual timeout
fuzz: $(STAMP)
	SAGAWORKER_FUZZ=1 $(BIN)/pytest --timeout 1800 tests/statemachine/test_state_machine.py

# guard mutations the model checker must catch, each applied to a copy of the library
# (tests/statemachine/mutants.py): fails if one survives or no longer applies to the source
mutants: $(STAMP)
	$(BIN)/python -m tests.statemachine.mutants

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench

web: $(STAMP)
	$(BIN)/flask --app tasks.web:create_app run

# The dashboard's browser test needs Debian's chromium (CI installs it through this).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# PgBouncer, for the test that a journal behind a connection pooler is refused (CI installs
# it through this, as chromium; the test runs it on a port of its own)
pooler:
	@command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null; }

clean:
	rm -rf $(VENV) .venv-3.* .venv-lowest .pytest_cache .mypy_cache .ruff_cache *.egg-info
