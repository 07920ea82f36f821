#!/usr/bin/env bash
# Builds kvpilot-device-plugin (this module: simulated GPUs for the kubelet's
# device-plugin API) once per version, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/deviceplugin/<version>/bin
# Bump VERSION when the code changes. Test with: go test ./...
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
gobuild_ready deviceplugin "$VERSION" kvpilot-device-plugin && exit 0
gobuild deviceplugin "$VERSION" kvpilot-device-plugin "" "-s -w" ./cmd/kvpilot-device-plugin
