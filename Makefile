# Tether developer entry points. `make test` is what CI runs (.ci/run).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Cluster tests mostly wait on leases and conditions, so more workers than cores pays off.
PYTEST_WORKERS ?= 4
export GOTOOLCHAIN := local

.PHONY: help install browser release control-plane tools node kueue kind-image test layers unit sdk-test conformance chaos bench bench-queues demo cluster e2e-kind docs screenshots plugin install-plugin install-tools crd-schema clean

help:
	@echo "make test           install, build the control plane (cached), run every test"
	@echo "make demo           the main job: local cluster, operator, examples, a lost worker, timelines"
	@echo "make unit           pure unit tests only (no cluster)"
	@echo "make sdk-test       the TypeScript and Go SDKs' own unit tests (npm test, go vet + go test)"
	@echo "make conformance    every conformance scenario against the Python, TypeScript and Go workers (a table)"
	@echo "make chaos          seeded fault trials judged from the audit log (TRIALS=300 SEED=1; not in make test)"
	@echo "make bench          scale benchmarks on kwok nodes: JSON, figures, table in docs/benchmarks.md (not in make test)"
	@echo "make bench-queues   runs and Kueue Jobs through one ClusterQueue; preemption latency (not in make test)"
	@echo "make screenshots    the console's browser tests, saving docs/console-*.png (make test saves them outside the tree)"
	@echo "make cluster        start a local control plane and print its KUBECONFIG (KUEUE=1: with Kueue)"
	@echo "make docs           build the docs site (mkdocs --strict, outside the tree) and check every internal link"
	@echo "make crd-schema     regenerate spec.template's pod schema in the WorkerRun CRDs (after a Kubernetes bump)"
	@echo "make e2e-kind       a kind cluster from a node image built here: the chart, then the e2e suite on it"
	@echo "make kind-image     build/cache kind and its node image (Kubernetes, CoreDNS, containerd from Go modules)"
	@echo "make plugin         the kubectl-tether wheel and krew archive in dist/, with dist/tether.yaml (krew manifest)"
	@echo "make install-plugin kubectl-tether in a virtualenv of its own, linked into PREFIX/bin (PREFIX=~/.local)"
	@echo "make install-tools  helm and kubectl into PREFIX/bin, unless on PATH (a missing one is built, cached)"
	@echo "make release        every release artefact in dist/: images (OCI archives), the pinned chart, the plugin, SHA256SUMS"
	@echo "make control-plane  build/cache etcd, kube-apiserver, controller-manager, scheduler, kubectl (and the oldest supported)"
	@echo "make kueue          build/cache Kueue's manager (sigs.k8s.io/kueue) with its CRDs and webhooks"
	@echo "make node           build/cache kubelet, containerd, the pause image and the Tether image (docker build)"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Debian's Chromium for the console's browser tests (Playwright drives it; no browser download).
browser:
	bash hack/install-browser.sh

control-plane:
	bash hack/build-control-plane.sh
	bash hack/build-control-plane.sh --oldest

tools:
	bash hack/build-tools.sh
	bash hack/build-kwok.sh
	bash hack/build-promtool.sh

# The real node (tests/node): kubelet and containerd from Go modules, runc and CNI from Debian, the
# image from this checkout's Dockerfile on a debootstrapped base (Docker is installed and started).
node:
	bash hack/build-node.sh
	bash hack/build-images.sh

# Kueue's manager, for tests/kueue (queueing through Kueue): built from Go modules, cached.
kueue:
	bash hack/build-kueue.sh

# kind and its node image, built here (hack/build-kind.sh): tests/kind, make e2e-kind.
kind-image: node
	bash hack/build-kind.sh

# The tests of admission, approvals, fencing and queueing, again on the oldest supported Kubernetes.
# (Kueue's tests share one manager and run one after another: the ones that admit, preempt, fence a
# worker that ignores the yield and keep quota from a run awaiting review, within CI's time.)
KUEUE_ON_OLDEST := test_a_cluster_queue_quota_caps_running_runs_and_the_rest_wait_queued \
	test_a_higher_priority_run_preempts_a_running_one_that_yields_and_resumes \
	test_a_worker_that_ignores_the_yield_is_fenced_and_killed_after_its_grace test_a_run_waiting_for_its_start_review_holds_no_quota
OLDEST_TESTS ?= tests/cluster/test_admission_policy.py tests/cluster/test_approvals.py tests/cluster/test_crd_validation.py \
	tests/cluster/test_workerclass.py \
	tests/e2e/test_fencing.py tests/e2e/test_review_gates.py tests/e2e/test_identity.py \
	$(addprefix tests/kueue/test_queues.py::,$(KUEUE_ON_OLDEST))

# The 1.34 pass runs beside the main one, on a control plane of its own (its output follows the
# main pass's): the main pass spends most of its time waiting on leases and intervals, not on the CPU.
OLDEST_WORKERS ?= 2
OLDEST_LOG := .tether/test-oldest.log
# The SDKs' own tests run beside the installs and builds (mostly one core each: pip, docker build),
# and their output is printed once those are done.
SDK_LOG := .tether/sdk-test.log
test:
	@mkdir -p .tether; \
	$(MAKE) --no-print-directory sdk-test > $(SDK_LOG) 2>&1 & sdk=$$!; \
	$(MAKE) --no-print-directory install browser control-plane tools node kueue kind-image layers; built=$$?; \
	wait $$sdk; sdk=$$?; echo "=== make sdk-test"; cat $(SDK_LOG); \
	test $$built = 0 && test $$sdk = 0 || exit 1; \
	TETHER_TEST_KUBERNETES=oldest $(PY) -m pytest -n $(OLDEST_WORKERS) --dist loadgroup -p no:cacheprovider -ra \
		--durations=10 $(OLDEST_TESTS) > $(OLDEST_LOG) 2>&1 & oldest=$$!; \
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -p no:cacheprovider -ra --durations=40; main=$$?; \
	wait $$oldest; old=$$?; \
	echo "=== the same tests on the oldest supported Kubernetes (1.34): $(OLDEST_TESTS)"; cat $(OLDEST_LOG); \
	test $$main = 0 && test $$old = 0

# The layers are a checked contract (pyproject.toml [tool.importlinter]).
layers: install
	cd operator && ../$(VENV)/bin/lint-imports --no-cache --config ../pyproject.toml

# The worker SDKs in other languages (sdk/): dependencies from npm and the Go module proxy.
SDK_TS := sdk/typescript
SDK_GO := sdk/go
$(SDK_TS)/node_modules/.installed: $(SDK_TS)/package-lock.json
	cd $(SDK_TS) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

sdk-test: $(SDK_TS)/node_modules/.installed
	cd $(SDK_TS) && npm test
	cd $(SDK_GO) && go vet ./... && go test -race -count=1 ./...

# The conformance kit (conformance/): scenario × SDK. CONFORMANCE_ARGS="--worker go --scenario stop", or any
# worker as --worker name=command.
CONFORMANCE_ARGS ?=
conformance: install control-plane $(SDK_TS)/node_modules/.installed
	$(PY) -m conformance $(CONFORMANCE_ARGS)

# The docs site (mkdocs.yml, docs/): built outside the tree; internal links and README's checked, external
# ones listed (not fetched). tests/unit/docs/test_docs.py runs the same check, so make test does not run this.
DOCS_SITE ?= $(or $(TETHER_CACHE),/tmp)/tether-site
docs: install
	$(PY) hack/check_docs.py --site-dir $(DOCS_SITE)

# spec.template's schema in crds/ and the chart's copy, from the pinned kube-apiserver's OpenAPI (started here).
crd-schema: install control-plane
	$(PY) hack/template_schema.py

unit: install
	$(PY) -m pytest -m unit -p no:cacheprovider -q tests/unit

# Randomized fault trials (benchmarks/chaos.py): trial i has seed SEED+i; a failure prints its replay command.
TRIALS ?= 300
SEED ?= 1
chaos: install control-plane
	$(PY) benchmarks/chaos.py --trials $(TRIALS) --seed $(SEED)

# Scale benchmarks (benchmarks/scale.py): kwok nodes, the simulated fleet, 5,000 live runs by default.
BENCH_OUT ?= benchmarks/results/$(shell date +%F).json
BENCH_ARGS ?=
bench: install control-plane tools
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/scale.py --out $(BENCH_OUT) $(BENCH_ARGS)
	$(PY) benchmarks/report.py $(BENCH_OUT)

# Queueing through Kueue at scale (benchmarks/queues.py): 1,000 runs and 1,000 Kueue Jobs through one
# ClusterQueue, and preemption -> yield -> requeue -> resume; the numbers go into docs/benchmarks.md by hand.
QUEUES_OUT ?= benchmarks/results/queues-$(shell date +%F).json
bench-queues: install control-plane tools kueue
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/queues.py --out $(QUEUES_OUT) $(BENCH_ARGS)

# The console's screenshots in docs/ come from its browser tests, only when asked for here.
screenshots: install browser control-plane
	TETHER_SCREENSHOTS=docs $(PY) -m pytest -p no:cacheprovider -q tests/e2e/test_console.py

demo: install control-plane
	$(VENV)/bin/tether dev demo

# KUEUE=1: with Kueue's manager too (docs/queues.md).
cluster: install control-plane $(if $(KUEUE),kueue)
	$(VENV)/bin/tether dev cluster $(if $(KUEUE),--kueue)

# The e2e suite on a kind cluster (hack/e2e-kind.sh): created, the image loaded, the chart installed, deleted.
e2e-kind: install control-plane tools node kind-image
	bash hack/e2e-kind.sh

# The kubectl plugin as users install it (packaging/kubectl-tether/build.py): a small wheel without
# the operator's dependencies, and krew's archive. A release sets KREW_MANIFEST_OUT=krew/tether.yaml.
PREFIX ?= $(HOME)/.local
PLUGIN_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
KREW_MANIFEST_OUT ?= dist/tether.yaml
plugin: install
	$(PY) packaging/kubectl-tether/build.py --out dist --manifest-out $(KREW_MANIFEST_OUT)

# As pipx would: a virtualenv of its own under PREFIX/lib, its entry point linked into PREFIX/bin.
install-plugin: plugin
	rm -rf $(PREFIX)/lib/kubectl-tether
	$(PYTHON) -m venv $(PREFIX)/lib/kubectl-tether
	$(PREFIX)/lib/kubectl-tether/bin/python -m pip install --quiet dist/kubectl_tether-$(PLUGIN_VERSION)-py3-none-any.whl
	mkdir -p $(PREFIX)/bin
	ln -sf $(PREFIX)/lib/kubectl-tether/bin/kubectl-tether $(PREFIX)/bin/kubectl-tether
	@echo "kubectl-tether is in $(PREFIX)/bin (on your PATH? then: kubectl tether --help)"

# helm and kubectl: the ones on PATH, else built here (cached) and linked into PREFIX/bin.
install-tools:
	bash hack/install-tools.sh $(PREFIX)

# What a release publishes, into dist/ (packaging/release.py; docs/own-cluster.md): needs the image
# build (Linux, root, Docker) and helm.
release: install
	$(PY) packaging/release.py --out dist

clean:
	rm -rf $(VENV) .tether
