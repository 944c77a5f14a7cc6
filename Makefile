# The README's commands. Each one creates or reuses .venv at the repo root,
# installs the pinned dependencies, MPI from PyPI (mpich) and nbdist itself.
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.nbdist-installed
PYTHON  ?= python3
N       ?= 4

.PHONY: demo demo-batch test lab bench doctor clean

$(STAMP): requirements.txt pyproject.toml CMakeLists.txt $(wildcard native/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip==26.3 >/dev/null || true
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)  ## execute the quickstart notebook headless (4 ranks) and print its outputs
	$(BIN)/python -m nbdist.cli.run_notebook notebooks/quickstart.ipynb --out build/quickstart.executed.ipynb

demo-batch: $(STAMP)  ## the batch twin: real distributed work on $(N) local ranks
	$(BIN)/nbdist run -n $(N) examples/demo.py

test: $(STAMP)  ## the whole test suite (multi-rank tests under mpiexec -n 2 and -n 4)
	$(BIN)/pytest tests

lab: $(STAMP)  ## JupyterLab on notebooks/
	$(BIN)/jupyter lab notebooks/

bench: $(STAMP)  ## collective benchmarks, nbdist beside its peers
	$(BIN)/nbdist bench

doctor: $(STAMP)
	$(BIN)/nbdist doctor

clean:
	rm -rf $(VENV) build
