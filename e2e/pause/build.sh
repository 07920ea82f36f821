#!/usr/bin/env bash
# Builds the Pod sandbox's pause program (this module, static) once per
# version, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/pause/<version>/bin
# Bump VERSION when the code changes. Test with: go test ./...
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
gobuild_ready pause "$VERSION" pause && exit 0
gobuild pause "$VERSION" pause "" "-s -w -X main.version=$VERSION" .
