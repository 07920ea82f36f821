#!/usr/bin/env bash
# Builds KEDA's operator (cmd/operator) and metrics API server (cmd/adapter)
# from the Go module proxy with this wrapper module, once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/keda/<version>/bin/{operator,adapter}
# No images, no release downloads: the binaries run as host processes next to
# the local cluster (e2e/localcluster/keda.py). KEDA bundles every scaler, so
# the first build compiles a few thousand packages (cloud SDKs included).
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
BINARIES="operator adapter"
gobuild_ready keda "$VERSION" "$BINARIES" && exit 0
# KEDA's Makefile sets these two (VERSION without the v, as its release images do).
v=github.com/kedacore/keda/v2/version
ldflags="-s -w -X $v.Version=${VERSION#v} -X $v.GitCommit=$VERSION"
gobuild keda "$VERSION" "$BINARIES" "" "$ldflags" \
  github.com/kedacore/keda/v2/cmd/operator github.com/kedacore/keda/v2/cmd/adapter
