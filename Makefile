# Two commands from a fresh clone: `make demo` and `make test` (`make test-fast` while editing).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean setup-libero

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Reinstall only when the dependency list or the constraints change.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	MUJOCO_GL=$${MUJOCO_GL:-egl} $(BIN)/embodied-rl quickstart

# `make test` runs every test (what CI runs); `make test-fast` leaves out the end-to-end and slow
# ones (pytest marks e2e, slow: pyproject.toml) for the edit-test loop. pytest exits 5 when it
# collected no tests: that is a failure, never a silent pass. Tests run in TEST_WORKERS processes
# (pytest-xdist; 2 = the 2-core machine CI runs on), each test on one torch thread (tests/conftest.py).
TEST_WORKERS ?= 2
PYTEST = MUJOCO_GL=$${MUJOCO_GL:-egl} OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)
NO_TESTS = status=$$?; if [ $$status -eq 5 ]; then echo "make $@: pytest collected no tests" >&2; fi; exit $$status

test: install
	$(PYTEST); $(NO_TESTS)

test-fast: install
	$(PYTEST) -m "not e2e and not slow"; $(NO_TESTS)

# LIBERO's own venv (robosuite 1.4, mujoco 3.3.7) for task=libero/...: docs/backends.md
setup-libero: install
	$(BIN)/embodied-rl setup-sim libero

lint: install
	$(BIN)/ruff check embodied_rl tests benchmarks scripts

clean:
	rm -rf $(VENV) build dist *.egg-info
