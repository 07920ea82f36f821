# The local Kubernetes (e2e/): included by the top Makefile.
#   make node-deps      the Debian packages the node needs (runc, iptables, ...; e2e/node-deps.sh)
#   make cluster-build  build Kubernetes, containerd, the CNI plugins, CoreDNS, Prometheus, KEDA
#                       and kvpilot's image once (cached in ~/.cache/kvpilot/)
#   make cluster-up     start it in the background; writes .cluster/kubeconfig and .cluster/env
#   make cluster-down   stop exactly the processes cluster-up started
#   make cluster-status what is running
# Included near the top of the Makefile: keep whatever goal was the default.
_cluster_mk_default_goal := $(.DEFAULT_GOAL)
CLUSTER_DIR ?= $(CURDIR)/.cluster
LOCALCLUSTER = cd e2e && $(abspath $(PY)) -m localcluster

.PHONY: node-deps cluster-build cluster-up cluster-down cluster-status

node-deps:
	e2e/node-deps.sh

cluster-build: dev node-deps
	$(LOCALCLUSTER) build

cluster-up: dev node-deps
	$(LOCALCLUSTER) up --dir $(CLUSTER_DIR)

cluster-down:
	$(LOCALCLUSTER) down --dir $(CLUSTER_DIR)

cluster-status:
	$(LOCALCLUSTER) status --dir $(CLUSTER_DIR)

.DEFAULT_GOAL := $(_cluster_mk_default_goal)
