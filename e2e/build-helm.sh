#!/usr/bin/env bash
# Builds `helm` from its Go module (helm.sh/helm/v3/cmd/helm at a pinned
# version), once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/helm/<version>/helm
# Go's module and build caches (outside the repository) are reused.
# Prints the binary's path on stdout as its last line; progress goes to stderr.
set -euo pipefail
VERSION=${KVPILOT_HELM_VERSION:-v3.21.4}
CACHE=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}/helm/${VERSION}
BIN=$CACHE/helm

if [[ -x $BIN && -f $CACHE/.complete ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then
  echo "[helm-build] another build of $VERSION is running; waiting for it" >&2
  flock 9
fi
if [[ -x $BIN && -f $CACHE/.complete ]]; then echo "$BIN"; exit 0; fi

command -v go >/dev/null || { echo "[helm-build] Go is required" >&2; exit 1; }
log() { echo "[helm-build $(date +%H:%M:%S)] $*" >&2; }
start=$(date +%s)
tmp=$(mktemp -d "$CACHE/tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOBIN=$tmp GOFLAGS=-buildvcs=false
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=${VERSION}"
log "building helm ${VERSION} from the Go module proxy (the first build on a machine takes a few minutes)"
# -v names each package as it compiles it; report progress every 50 packages or 30 s.
go install -v -trimpath -ldflags="$ldflags" "helm.sh/helm/v3/cmd/helm@${VERSION}" 2>&1 | {
  n=0; last=$(date +%s)
  while IFS= read -r line; do
    case $line in
      *" "*|"#"*) echo "$line" >&2; continue;;
    esac
    n=$((n + 1)); now=$(date +%s)
    if (( n % 50 == 0 || now - last >= 30 )); then
      log "compiled $n packages ($(( now - start ))s elapsed) $line"
      last=$now
    fi
  done
}
[[ ${PIPESTATUS[0]} == 0 ]] || { log "build failed"; exit 1; }
mv -f "$tmp/helm" "$BIN"
touch "$CACHE/.complete"
log "done in $(( $(date +%s) - start ))s: $BIN"
echo "$BIN"
