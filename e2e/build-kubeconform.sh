#!/usr/bin/env bash
# Builds `kubeconform` from its Go module (github.com/yannh/kubeconform at a pinned version),
# once per machine, into ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/kubeconform/<version>/kubeconform.
# Prints its folder on stdout as its last line (tests/go_tools.py); progress goes to stderr. Its schemas
# are generated locally (tests/k8s_schemas.py): nothing is downloaded at test time.
set -euo pipefail
VERSION=${KVPILOT_KUBECONFORM_VERSION:-v0.7.0}
CACHE=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}/kubeconform/${VERSION}
BIN=$CACHE/kubeconform

if [[ -x $BIN ]]; then echo "$CACHE"; exit 0; fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9
if [[ -x $BIN ]]; then echo "$CACHE"; exit 0; fi
command -v go >/dev/null || { echo "[kubeconform-build] Go is required" >&2; exit 1; }
tmp=$(mktemp -d "$CACHE/tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "[kubeconform-build] building kubeconform ${VERSION} from the Go module proxy" >&2
CGO_ENABLED=0 GOBIN=$tmp GOFLAGS=-buildvcs=false go install -trimpath -ldflags="-s -w" \
  "github.com/yannh/kubeconform/cmd/kubeconform@${VERSION}" >&2
mv -f "$tmp/kubeconform" "$BIN"
echo "$CACHE"
