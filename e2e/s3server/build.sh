#!/usr/bin/env bash
# Builds s3server (main.go: gofakes3 from github.com/johannesboyne/gofakes3, an
# S3-compatible server, with byte counters and a throttle for the s3:// model source tests)
# once per machine into ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/s3server/<version>/bin.
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
# The cache key holds a hash of main.go, so an edit rebuilds.
VERSION=$(cat VERSION)-$(sha256sum main.go | cut -c1-12)
gobuild s3server "$VERSION" "s3server" "" "-s -w" .
