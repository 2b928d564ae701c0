# The only entry points: `make demo`, `make test`, `make bench`, `make plots` (and their parts).
# Every target sets up what it needs (a virtual environment with pinned packages, a release
# build of the extension) and is safe to run again.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
BENCH_STAMP := $(VENV)/.bench-deps-installed
BUILT   := $(VENV)/.mcp-built
PYDIRS  := python tests benches examples
RUST_SRC := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml Cargo.lock pyproject.toml

.PHONY: demo test bench plots build-dev lint fmt rust-test py-test wheel-test clean net-tools

$(PY):
	python3 -m venv $(VENV)

$(STAMP): requirements/dev.txt requirements/constraints.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/dev.txt -c requirements/constraints.txt
	touch $@

$(BUILT): $(STAMP) $(RUST_SRC)
	. $(VENV)/bin/activate && maturin develop --release --quiet
	touch $@

build-dev: $(BUILT)

$(BENCH_STAMP): requirements/bench.txt $(STAMP)
	$(PY) -m pip install -q -r requirements/bench.txt -c requirements/constraints.txt
	touch $@

# What the lossy-link tests and the demo use, installed from Debian when running as root:
# nftables (silent packet loss in a network namespace) and iproute2 (namespaces, tbf).
net-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	    && { ! command -v nft >/dev/null || ! command -v ip >/dev/null; }; then \
	  echo "== installing nftables and iproute2 (Debian) for the lossy-link tests"; \
	  apt-get update -qq >/dev/null 2>&1 || true; \
	  apt-get install -y -qq nftables iproute2 >/dev/null 2>&1 || true; fi

# The main job: the same DDP training (examples/train_ddp.py, same seed) in two processes over
# Gloo, then over MCP, on the same lossy private link when this machine allows it (root,
# iproute2, nftables: installed from Debian if missing), else loopback; ends with the two side
# by side (examples/demo_compare.py; the Gloo run is stopped after GLOO_LIMIT seconds).
GLOO_LIMIT ?= 90
demo: $(BUILT) net-tools
	$(PY) examples/collectives_demo.py --world 3 --mib 16
	$(PY) examples/demo_compare.py --loss 0.1 --gloo-limit $(GLOO_LIMIT)

lint: $(STAMP)
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	$(VENV)/bin/ruff check $(PYDIRS)
	$(VENV)/bin/ruff format --check $(PYDIRS)

fmt: $(STAMP)
	cargo fmt --all
	$(VENV)/bin/ruff format $(PYDIRS)
	$(VENV)/bin/ruff check --fix $(PYDIRS)

rust-test:
	cargo test -p mcp-delta -p mcp-core

py-test: $(BUILT) net-tools
	$(PY) -m pytest

test: lint rust-test py-test

bench: $(BUILT) $(BENCH_STAMP)
	$(PY) -m pytest benches --benchmark-enable --benchmark-columns=min,median,mean,ops
	$(PY) benches/compare_gloo.py
	$(PY) benches/delta_vs_zipnn.py
	$(PY) benches/bench_failure_detection.py --runs 20
	$(PY) benches/bench_elastic.py
	$(PY) benches/bench_ps.py

# The figures of docs/benchmarks.md and the README (docs/img/*.png) from the JSON the benchmarks
# write with --json (docs/data/*.json; the command that made each is in its "meta").
plots: $(BENCH_STAMP)
	$(PY) benches/plots.py --data docs/data --out docs/img

clean:
	rm -rf target $(VENV) dist .pytest_cache .ruff_cache
