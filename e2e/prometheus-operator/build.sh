#!/usr/bin/env bash
# Builds the Prometheus Operator (cmd/operator) and its config reloader
# (cmd/prometheus-config-reloader) from the Go module proxy with this wrapper
# module, once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/prometheus-operator/<version>/bin
# The operator runs as a host process next to the local cluster; the reloader
# goes into the Prometheus image it starts (e2e/localcluster/monitoring.py).
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
BINARIES="operator prometheus-config-reloader"
# The CustomResourceDefinitions of this release, from its module source, beside bin/.
copy_crds() {
  local bin=$1 src
  src=$(go mod download -json github.com/prometheus-operator/prometheus-operator | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  mkdir -p "$bin/../crds"
  cp -f "$src"/example/prometheus-operator-crd/monitoring.coreos.com_*.yaml "$bin/../crds/"
  chmod u+w "$bin/../crds/"*.yaml
}
if bin=$(gobuild_ready prometheus-operator "$VERSION" "$BINARIES"); then
  [[ -f $bin/../crds/monitoring.coreos.com_prometheuses.yaml ]] || copy_crds "$bin" >&2
  echo "$bin"; exit 0
fi
# The project's Makefile stamps these (github.com/prometheus/common/version).
v=github.com/prometheus/common/version
ldflags="-s -w -X $v.Version=${VERSION#v} -X $v.Branch=release -X $v.BuildUser=kvpilot"
bin=$(gobuild prometheus-operator "$VERSION" "$BINARIES" "" "$ldflags" \
  github.com/prometheus-operator/prometheus-operator/cmd/operator \
  github.com/prometheus-operator/prometheus-operator/cmd/prometheus-config-reloader | tail -1)
copy_crds "$bin" >&2
echo "$bin"
