# Two commands from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

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

# pytest exits 5 when it collected no tests: that is a failure, never a silent pass.
test: install
	MUJOCO_GL=$${MUJOCO_GL:-egl} $(BIN)/python -m pytest -q -p no:cacheprovider; \
	status=$$?; if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$status

lint: install
	$(BIN)/ruff check embodied_rl tests benchmarks scripts

clean:
	rm -rf $(VENV) build dist *.egg-info
