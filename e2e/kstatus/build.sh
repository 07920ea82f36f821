#!/usr/bin/env bash
# Builds kstatus-check (main.go: kstatus from sigs.k8s.io/cli-utils, the library Flux and kpt
# compute health with) once per machine into ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/kstatus/<version>/bin.
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
# The cache key holds a hash of main.go, so an edit rebuilds.
VERSION=$(cat VERSION)-$(sha256sum main.go | cut -c1-12)
gobuild kstatus "$VERSION" "kstatus" "" "-s -w" .
