# Sourced by k8s/build.sh and prometheus/build.sh: builds Go programs from the
# wrapper module in the current folder once, into a cache folder keyed by
# version, with progress on stderr; prints the bin folder on stdout.
#
#   gobuild_ready CACHE_SUBDIR VERSION "BINARIES"   (prints the bin folder if built)
#   gobuild CACHE_SUBDIR VERSION "BINARIES" "TAGS" "LDFLAGS" PACKAGE...
#
# Go's build and module caches (GOCACHE, GOMODCACHE) stay where Go keeps them,
# outside the repository, so a rebuild after a version bump reuses them.
gobuild_ready() {
  local bin=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}/$1/$2/bin b
  [[ -f $bin/.complete ]] || return 1
  for b in $3; do [[ -x $bin/$b ]] || return 1; done
  echo "$bin"
}

gobuild() {
  local subdir=$1 version=$2 binaries=$3 tags=$4 ldflags=$5
  shift 5
  local cache=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}/$subdir/$version
  local bin=$cache/bin
  _have_all() { gobuild_ready "$subdir" "$version" "$binaries" >/dev/null; }
  if _have_all; then echo "$bin"; return 0; fi
  mkdir -p "$cache"
  exec 9>"$cache/.build.lock"
  if ! flock -n 9; then
    echo "[build $subdir] another build of $version is running; waiting for it" >&2
    flock 9
  fi
  if _have_all; then echo "$bin"; return 0; fi
  command -v go >/dev/null || { echo "[build $subdir] Go is required" >&2; return 1; }
  local start; start=$(date +%s)
  _log() { echo "[build $subdir $(date +%H:%M:%S)] $*" >&2; }
  _log "downloading modules for $version (Go module proxy)"
  go mod download
  export CGO_ENABLED=0
  local total; total=$(go list -tags "$tags" -deps "$@" | wc -l)
  _log "building $binaries $version ($total packages; the first build on a machine takes a while)"
  local tmp; tmp=$(mktemp -d "$cache/tmp.XXXXXX")
  # go build -v names each package as it compiles it (cached ones are skipped).
  go build -v -trimpath -tags "$tags" -ldflags="$ldflags" -o "$tmp/" "$@" 2>&1 | {
    local n=0 last now line
    last=$(date +%s)
    while IFS= read -r line; do
      # A package path has no blanks; anything else is a compiler message.
      case $line in
        *" "*|"#"*) echo "$line" >&2; continue;;
      esac
      n=$((n + 1)); now=$(date +%s)
      if (( n % 100 == 0 || now - last >= 30 )); then
        _log "compiled $n/$total packages ($(( now - start ))s elapsed) $line"
        last=$now
      fi
    done
  }
  if [[ ${PIPESTATUS[0]} != 0 ]]; then _log "build failed"; rm -rf "$tmp"; return 1; fi
  mkdir -p "$bin"
  local b
  for b in $binaries; do mv -f "$tmp/$b" "$bin/$b"; done
  rm -rf "$tmp"
  touch "$bin/.complete"
  _log "done in $(( $(date +%s) - start ))s: $bin"
  echo "$bin"
}
