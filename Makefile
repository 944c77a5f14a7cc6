# The README's commands. Each one creates or reuses .venv at the repo root,
# installs the pinned dependencies, MPI from PyPI (mpich) and nbdist itself.
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.nbdist-installed
PYTHON  ?= python3
N       ?= 4
# requirements.txt pins PyTorch's CPU build (torch==X+cpu), which PyPI does not serve: it
# comes from PyTorch's CPU wheel index. Where pip finds that wheel without the index (a
# local folder in PIP_FIND_LINKS, or torch already installed) the index is not asked at all,
# so an unreachable download.pytorch.org costs nothing there.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIN   := $(shell sed -n 's/^torch==//p' requirements.txt)
COURSE      := $(sort $(wildcard notebooks/0[1-9]-*.ipynb))

.PHONY: demo demo-batch test lab bench doctor clean notebooks notebooks-clean

$(STAMP): requirements.txt pyproject.toml CMakeLists.txt $(wildcard native/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip==26.3 >/dev/null || true
	$(BIN)/pip install -r requirements.txt $$($(BIN)/pip install --dry-run --no-deps --no-index -q \
	    "torch==$(TORCH_PIN)" >/dev/null 2>&1 || echo --extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)  ## execute the quickstart notebook headless (4 ranks) and print its outputs
	$(BIN)/python -m nbdist.cli.run_notebook notebooks/quickstart.ipynb --out build/quickstart.executed.ipynb

notebooks: $(STAMP)  ## execute the course notebooks 01-07 headless (2 ranks each); executed copies and logs in build/notebooks/
	@mkdir -p build/notebooks
	@for nb in $(COURSE); do \
	    name=$$(basename $$nb .ipynb); start=$$(date +%s); \
	    $(BIN)/python -m nbdist.cli.run_notebook $$nb --out build/notebooks/$$name.ipynb \
	        >build/notebooks/$$name.log 2>&1 \
	        || { tail -n 40 build/notebooks/$$name.log; echo "FAILED: $$nb (build/notebooks/$$name.log)"; exit 1; }; \
	    echo "$$name: every cell ran in $$(( $$(date +%s) - start )) s"; \
	done

notebooks-clean: $(STAMP)  ## strip outputs and widget state from notebooks/*.ipynb (before committing)
	$(BIN)/jupyter nbconvert --clear-output --inplace --log-level=WARN notebooks/*.ipynb
	$(BIN)/python -c "import sys, nbformat; [nbformat.write(nb, p) for p in sys.argv[1:] \
	    for nb in [nbformat.read(p, 4)] if nb.metadata.pop('widgets', None) is not None]" notebooks/*.ipynb

demo-batch: $(STAMP)  ## the batch twin: real distributed work on $(N) local ranks
	$(BIN)/nbdist run -n $(N) examples/demo.py

test: $(STAMP)  ## lint and types, then the whole test suite (multi-rank tests under mpiexec -n 2 and -n 4)
	$(BIN)/ruff check nbdist tests benchmarks
	$(BIN)/mypy
	$(BIN)/pytest tests

lab: $(STAMP)  ## JupyterLab on notebooks/
	$(BIN)/jupyter lab notebooks/

bench: $(STAMP)  ## collective benchmarks, nbdist beside its peers
	$(BIN)/nbdist bench

doctor: $(STAMP)
	$(BIN)/nbdist doctor

clean:
	rm -rf $(VENV) build
