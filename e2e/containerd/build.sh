#!/usr/bin/env bash
# Builds containerd 2.x (the node's container runtime; Debian's is 1.6, which
# Kubernetes after 1.35 no longer supports), its runc shim and ctr from the Go
# module proxy, once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/containerd/<version>/bin
# Static (no cgo): the btrfs snapshotter needs cgo and the node uses overlayfs,
# so it is left out with containerd's own build tags, as are devmapper and zfs.
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
BINARIES="containerd containerd-shim-runc-v2 ctr"
gobuild_ready containerd "$VERSION" "$BINARIES" && exit 0
v=github.com/containerd/containerd/v2/version
ldflags="-s -w -X $v.Version=$VERSION -X $v.Revision=kvpilot -X $v.Package=github.com/containerd/containerd/v2"
gobuild containerd "$VERSION" "$BINARIES" "no_btrfs no_devmapper no_zfs urfave_cli_no_docs" "$ldflags" \
  github.com/containerd/containerd/v2/cmd/containerd \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
  github.com/containerd/containerd/v2/cmd/ctr
