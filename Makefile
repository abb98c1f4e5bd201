# Kascade: developer and operator targets. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
KASCADE := $(VENV)/bin/kascade
QUICK ?=
BENCHES ?= planner transfer live reaction sim router engine detok engine_keepalive pd hostcopy
NAMESPACE ?= kascade-system
KUBECONFIG ?= $(HOME)/.cache/kascade/cluster/kubeconfig
IMAGE ?= ghcr.io/kascade/kascade-engine:dev
OPERATOR_IMAGE ?= ghcr.io/kascade/kascade-operator:dev
export KUBECONFIG

.PHONY: help install test chaos check check-kind lint typecheck bench e2e e2e-kind manifests chart-lint \
        cluster-up cluster-down deploy undeploy images lock demo clean

help: ## List targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

install: ## Fresh machine: system tools, venv with every extra, test model, local control plane
	bash hack/install.sh

test: ## Run the test suite (real control plane, real engines; skips with reasons where absent)
	bash hack/pytest.sh -m "not chaos and not kind"

chaos: ## Data-plane fault matrix: kill/stop/cut/desync/throttle x source/first/middle/last x tcp/ucx
	bash hack/pytest.sh tests/dataplane -m chaos

check: lint typecheck test chaos check-kind ## Everything CI runs after install

check-kind: # the kind e2e where Docker runs (CI=true: always; hack/build-kind.sh installs and starts it)
	@if [ "$${CI:-}" = true ] || docker info >/dev/null 2>&1; then $(MAKE) e2e-kind; \
	 else echo "check: no Docker daemon answers: the kind e2e (make e2e-kind) is skipped"; fi

lint: ## ruff, import contracts, CRDs in the chart equal crds/
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) hack/sync_manifests.py --check
	$(PY) hack/observability.py --check
	$(PY) hack/gen_api_reference.py --check
	$(PY) hack/gen_values_reference.py --check

TYPED_MODULES := -p kascade_devcluster -p kascade_demo -p kascade_router -m kascade_engine.arena -m kascade_engine.blocks -m kascade_engine.blockverify -m kascade_engine.hostcache \
	-m kascade_engine.transport -m kascade_engine.peerauth -m kascade_engine.transport_tcp -m kascade_engine.transport_ucx -m kascade_engine.ucxrequest -m kascade_engine.transport_tls \
	-m kascade_engine.transfer_spec -m kascade_engine.modelsource -m kascade_engine.httpguard -m kascade_engine.relay -m kascade_engine.forwarding -m kascade_engine.recovery -m kascade_engine.pacing -m kascade_engine.loader \
	-m kascade_engine.config -m kascade_engine.instance -m kascade_engine.serving -m kascade_engine.control \
	-m kascade_engine.pages -m kascade_engine.cooperation -m kascade_engine.pairclient -m kascade_engine.migration -m kascade_engine.pairsession -m kascade_engine.redirect -m kascade_engine.liveredirect -m kascade_engine.peerpool -m kascade_engine.livepolicy -m kascade_engine.timeline -m kascade_engine.scheduler -m kascade_engine.families -m kascade_engine.kvcache \
	-m kascade_engine.engine -m kascade_engine.model -m kascade_engine.metrics -m kascade_engine.tensorfile \
	-m kascade_engine.openai_api -m kascade_engine.responder -m kascade_engine.server -m kascade_engine.detokenizer -m kascade_engine.tokenizer \
	-m kascade_engine.kv_wire -m kascade_engine.prefill_server -m kascade_engine.remote_prefill -m kascade_engine.pd_metrics -m kascade_engine.velocity -m kascade_engine.stepcost -m kascade_engine.handback -m kascade_engine.probe -m kascade_engine.hostcopy \
	-m kascade_operator.api -m kascade_operator.scaleplan -m kascade_operator.plandriver -m kascade_operator.engine_client \
	-m kascade_operator.pool -m kascade_operator.reconcile -m kascade_operator.operator_metrics -m kascade_operator.status \
	-m kascade_operator.podtemplate -m kascade_operator.decide -m kascade_operator.leader -m kascade_operator.roleobject -m kascade_operator.rolesync \
	-m kascade_cli.logsetup -m kascade_cli.probe -m kascade_cli.model_cmd -m kascade_operator.demand -m kascade_operator.livewiring -m kascade_engine.live -m kascade_operator.serving_gate \
	-m kascade_operator.pdscaling -m kascade_operator.converter -m kascade_operator.hostcopykeeper

typecheck: ## mypy: strict on the pure planner; data plane, loader, devcluster, API models and plan driver checked too
	$(VENV)/bin/mypy -p kascade_planner
	$(VENV)/bin/mypy --follow-imports=silent $(TYPED_MODULES)

bench: ## Benchmarks that print ratios (QUICK=1 for the short versions)
	@for b in $(BENCHES); do \
	  if [ -f bench/$$b.py ]; then echo "== bench $$b"; $(PY) bench/$$b.py $(if $(QUICK),--quick,) || exit 1; fi; \
	done

e2e: ## End-to-end tests only (real control plane + real engine processes)
	bash hack/pytest.sh tests/e2e -m "cluster"

e2e-kind: ## The story in pods on kind: node image and every image built here (hack/build-kind.sh), then tests/kind
	bash hack/build-control-plane.sh >/dev/null
	bash hack/build-kind.sh
	@if [ -f hack/build-images.sh ]; then IMAGES="operator engine-cpu" bash hack/build-images.sh; \
	 else echo "e2e-kind: no hack/build-images.sh here: the test uses the images already built"; fi
	bash hack/pytest.sh tests/kind -m kind -s

manifests: ## Copy crds/ into the Helm chart, render manifests/, generate the dashboard, alert rules, docs/api-reference.md and docs/values.md
	$(PY) hack/sync_manifests.py
	$(PY) hack/observability.py
	$(PY) hack/gen_api_reference.py
	$(PY) hack/gen_values_reference.py

chart-lint: ## helm lint the chart
	$$(readlink -f $(HOME)/.cache/kascade/bin/current)/helm lint charts/kascade

cluster-up: ## Start the local control plane (etcd, apiserver, kcm, scheduler, kwok) with fake GPU nodes
	$(KASCADE) cluster up

cluster-down: ## Stop the local control plane
	$(KASCADE) cluster down

deploy: ## Install or upgrade Kascade (CRDs first: Helm never upgrades them) into $$KUBECONFIG with Helm
	$$(readlink -f $(HOME)/.cache/kascade/bin/current)/kubectl apply --server-side --force-conflicts -f charts/kascade/crds/
	$$(readlink -f $(HOME)/.cache/kascade/bin/current)/helm upgrade --install kascade charts/kascade -n $(NAMESPACE) --create-namespace

undeploy: ## Remove the Helm release
	$$(readlink -f $(HOME)/.cache/kascade/bin/current)/helm uninstall kascade -n $(NAMESPACE)

images: ## Build the engine (CUDA) and operator images (needs Docker; not available on the dev machines)
	docker build -t $(IMAGE) .
	docker build -f Dockerfile.operator -t $(OPERATOR_IMAGE) .

lock: ## Regenerate requirements/*.lock (the images' pinned dependencies) with uv
	bash hack/lock.sh

demo: ## The main job: local control plane, Kascade, real engines, a burst, scale up and down
	$(KASCADE) demo

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
