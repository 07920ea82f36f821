#!/usr/bin/env bash
# Builds the CNI reference plugins the node's pods are wired with (bridge,
# host-local, loopback, portmap) from the Go module proxy, once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/cni/<version>/bin
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
BINARIES="bridge host-local loopback portmap"
gobuild_ready cni "$VERSION" "$BINARIES" && exit 0
p=github.com/containernetworking/plugins
ldflags="-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$VERSION"
gobuild cni "$VERSION" "$BINARIES" "" "$ldflags" \
  $p/plugins/main/bridge $p/plugins/ipam/host-local $p/plugins/main/loopback $p/plugins/meta/portmap
