#!/usr/bin/env bash
# Builds CoreDNS from the Go module proxy with only the plugins a cluster DNS
# needs (see main.go: no cloud back ends), once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/coredns/<version>/bin
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
gobuild_ready coredns "$VERSION" coredns && exit 0
gobuild coredns "$VERSION" coredns "" \
  "-s -w -X github.com/coredns/coredns/coremain.GitCommit=kvpilot-$VERSION" .
