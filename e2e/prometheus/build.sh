#!/usr/bin/env bash
# Builds Prometheus from the Go module proxy with only the Kubernetes, file and
# HTTP service discoveries (Prometheus's own build tags), once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/prometheus/<version>/bin
# Debian's prometheus package is built without Kubernetes discovery, hence this.
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
gobuild_ready prometheus "$VERSION" "prometheus promtool" && exit 0
# Prometheus 3.X.Y is published as the Go module version v0.3XX.Y.
minor=${VERSION#v0.3}; release="3.$((10#${minor%%.*})).${VERSION##*.}"
v=github.com/prometheus/common/version
ldflags="-s -w -X $v.Version=$release -X $v.Branch=release -X $v.BuildUser=kvpilot"
# promtool (same module, same release) checks and unit-tests the chart's alerting rules.
gobuild prometheus "$VERSION" "prometheus promtool" "remove_all_sd,enable_kubernetes_sd" "$ldflags" \
  github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool
