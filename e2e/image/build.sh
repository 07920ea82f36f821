#!/usr/bin/env bash
# `make image`: builds kvpilot/operator:<version> and kvpilot/engine:<version> (the
# Containerfile's two targets) on this machine, without Docker or a registry, and writes each
# as an OCI archive that containerd imports (`ctr -n k8s.io images import FILE` names it
# docker.io/kvpilot/<target>:<version>).
#
# Usage: e2e/image/build.sh [operator] [engine]   (default: both, operator first)
#
#   base    Debian bookworm from Debian's packages (e2e/image/base.sh, mmdebstrap), passed
#           as --build-arg BASE (with a C compiler, for the engine's Triton) and SLIM_BASE
#           (without): nothing is pulled from a container registry
#   build   buildah bud with cached layers; pip reaches PyPI over the host's network and
#           trusts the host's CA bundle (secret "pip-cert"); wheels stay in buildah's cache
#           mount (/var/tmp/buildah-cache) for the next build
#   archive ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/images/kvpilot-<target>-<version>-<hash>.oci.tar,
#           the hash covering every input (Containerfile, the files it copies, the base,
#           these scripts): an unchanged tree reuses the archive at once
#
# Progress goes to stderr (timestamped); stdout has one line per target asked for, its
# archive's path, in the order asked.
# Builds on one machine take turns (a lock), so concurrent callers share one build.
# Settings (environment): KVPILOT_IMAGE_COMPRESSION=gzip|zstd (default gzip, see below),
# KVPILOT_IMAGE_KEEP=N archives kept per target (default 1: the engine's is ~3.3 GB), KVPILOT_BUILDAH_DRIVER=overlay|vfs
# (default: overlay when the kernel allows it), KVPILOT_IMAGE_MIN_FREE_GIB (default 30: below
# it, superseded archives are removed before building, and earlier builds' images too when
# the dependencies changed; see make_room).
set -euo pipefail

# Layer compression, measured on this image (6.3 GB unpacked, 2 cores): gzip 86-143 s for a
# 3.3 GB archive, zstd 91 s for 2.9 GB. Uncompressed is not on offer: buildah 1.28 (and
# skopeo 1.9) always compress layers written to an OCI layout, whatever -D says. gzip is the
# default because every consumer reads it (containerd 2.x, umoci 0.4 in e2e/test_image.py);
# zstd is ~10% smaller and no slower, for containerd-only use.
COMPRESSIONS=(gzip zstd)

TARGETS=(operator engine)

main() {
    local here repo cache keep compression version targets=("$@") target
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    repo=$(cd "$here/../.." && pwd)
    source "$here/lib.sh"
    cache=${KVPILOT_CACHE_DIR:-$HOME/.cache/kvpilot}/images
    keep=${KVPILOT_IMAGE_KEEP:-1}
    compression=${KVPILOT_IMAGE_COMPRESSION:-gzip}
    ((${#targets[@]})) || targets=("${TARGETS[@]}")
    for target in "${targets[@]}"; do
        [[ " ${TARGETS[*]} " == *" $target "* ]] || { log "unknown target $target: expected ${TARGETS[*]}"; exit 1; }
    done
    [[ " ${COMPRESSIONS[*]} " == *" $compression "* ]] \
        || { log "KVPILOT_IMAGE_COMPRESSION=$compression: expected one of ${COMPRESSIONS[*]}"; exit 1; }
    version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml" | head -n1)
    [[ $(id -u) == 0 ]] || { log "needs root (buildah, mmdebstrap)"; exit 1; }

    mkdir -p "$cache"
    exec 9>"$cache/kvpilot-image.lock"
    if ! flock -n 9; then
        log "another build of kvpilot's images is running: waiting for it"
        flock 9
    fi

    ensure_tools
    choose_storage
    # Containers left by an interrupted build hold whole writable layers (GBs); under the
    # lock no other build of ours is running, and nothing else here uses buildah's storage.
    $BUILDAH rm --all >/dev/null 2>&1 || true

    # The operator image is built on the slim and runtime bases only; the full one (a C
    # compiler, the largest) is made only when the engine is a target.
    local base slim runtime slim_bases bases_of
    declare -A bases_of
    slim=$("$here/base.sh" slim | tail -n1)
    runtime=$("$here/base.sh" runtime | tail -n1)
    slim_bases="slim $($BUILDAH inspect --type image --format '{{.FromImageID}}' "$slim")"
    slim_bases="$slim_bases runtime $($BUILDAH inspect --type image --format '{{.FromImageID}}' "$runtime")"
    bases_of[operator]=$slim_bases
    base=$slim  # the engine stage's base; unused when only the operator is built
    if [[ " ${targets[*]} " == *" engine "* ]]; then
        base=$("$here/base.sh" full | tail -n1)
        bases_of[engine]="base $($BUILDAH inspect --type image --format '{{.FromImageID}}' "$base") $slim_bases"
    fi
    for target in "${targets[@]}"; do
        build_target "$target"
    done
}

# Builds one target (unless its archive for these inputs exists) and prints the archive.
build_target() {
    local target=$1 name ref hash archive start cert secret=() deps
    name=kvpilot/$target:$version
    ref=docker.io/$name # the name containerd (and so the kubelet) will know it by
    hash=$(inputs "$repo" "$here" "$target" "target $target ${bases_of[$target]} compression $compression" | sha256sum | cut -c1-12)
    archive=$cache/kvpilot-$target-$version-$hash.oci.tar
    if [[ -s $archive ]]; then
        log "up to date: $archive"
        echo "$archive"
        return
    fi

    buildlog=$(mktemp "${TMPDIR:-/tmp}/kvpilot-image-build.XXXXXX")
    trap 'rm -f "$buildlog"' EXIT
    # A certificate bundle for pip: the host's, which may hold a proxy's CA.
    cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
    [[ -s $cert ]] && secret=(--secret "id=pip-cert,src=$cert")
    deps=$(deps_key "$repo" "${bases_of[$target]}")
    make_room "$cache" "$version" "$target" "$deps"
    log "building $name (inputs $hash, storage $driver); the first build takes minutes"
    start=$SECONDS
    # --force-rm: a failed step's working container (the engine's holds 6 GB) goes too.
    $BUILDAH bud --layers --force-rm --pull=never -f "$repo/Containerfile" --target "$target" \
        --build-arg "BASE=$base" --build-arg "SLIM_BASE=$slim" --build-arg "RUNTIME_BASE=$runtime" "${secret[@]}" \
        --label "org.opencontainers.image.version=$version" \
        --label "org.opencontainers.image.title=kvpilot-$target" \
        --label "dev.kvpilot.image.inputs=$hash" \
        -t "localhost/$name" "$repo" 2>&1 | tee "$buildlog" | ts_stderr
    log "built in $((SECONDS - start))s"

    # Written beside its final name and renamed, so an interrupted push never looks done.
    # The name inside (index.json's org.opencontainers.image.ref.name) is the full
    # reference, which `ctr images import` keeps as the image's name.
    start=$SECONDS
    rm -f "$archive.partial"
    $BUILDAH push --quiet --format oci --compression-format "$compression" "localhost/$name" \
        "oci-archive:$archive.partial:$ref" 2>&1 | ts_stderr
    mv "$archive.partial" "$archive"
    log "archive written in $((SECONDS - start))s: $(du -h "$archive" | cut -f1) ($compression);" \
        "unpacked $($BUILDAH inspect --type image --format '{{.Size}}' "localhost/$name" 2>/dev/null | numfmt --to=si 2>/dev/null || echo '?')B"

    prune "$cache" "$target" "$keep" "$buildlog"
    echo "$deps" > "$cache/kvpilot-$target.deps"
    echo "$archive"
}

# A build that reinstalls the Python packages writes a ~6 GB layer and then a copy of it as
# it commits (seen failing at 23 GiB free, inside buildah: "read/write on closed pipe"),
# and the archive ~3.3 GB. A build whose dependency layers are cached (the Containerfile,
# pyproject.toml and the bases unchanged since the last build: a code change) writes only
# kvpilot's own small layers and the archive. So below MIN_FREE_GIB the target's superseded
# archives go first, and the earlier builds' images (their layers are the build cache) only
# when those layers could not be reused anyway: removing a cache that would be hit turns a
# build needing a few GiB into one needing over 20, the failure it was meant to avoid.
MIN_FREE_GIB=${KVPILOT_IMAGE_MIN_FREE_GIB:-30}
make_room() {
    local cache=$1 version=$2 target=$3 deps_key=$4 free
    free=$(free_gib "$cache")
    [[ -n $free ]] && ((free < MIN_FREE_GIB)) || return 0
    log "only ${free} GiB free (a build that reinstalls the dependencies may need ${MIN_FREE_GIB}):" \
        "removing the superseded archives of $target"
    rm -f "$cache"/kvpilot-"$target"-*.oci.tar  # the other target's archive may be in use
    if [[ $(cat "$cache/kvpilot-$target.deps" 2>/dev/null) == "$deps_key" ]]; then
        log "keeping the cached dependency layers of $target: only kvpilot's own layers are rebuilt"
    else
        log "the dependencies changed: removing earlier builds of $target (their layers are stale)"
        $BUILDAH rmi --force "localhost/kvpilot/$target:$version" >/dev/null 2>&1 || true
        $BUILDAH rmi --prune >/dev/null 2>&1 || true  # the dangling layers of earlier builds
    fi
    free=$(free_gib "$cache")
    log "now ${free} GiB free"
    [[ -n $free ]] && ((free >= MIN_FREE_GIB)) || log "warning: a build that reinstalls the dependencies may run out of disk"
}

# What the dependency layers of a target depend on (not kvpilot's own code): when unchanged
# since the last build, buildah reuses them.
deps_key() {
    local repo=$1 bases=$2
    { cd "$repo" && sha256sum Containerfile .dockerignore pyproject.toml; echo "$bases"; } | sha256sum | cut -c1-12
}

free_gib() {
    df -P --block-size=1G /var/lib/containers "$1" 2>/dev/null | awk 'NR > 1 {print $4}' | sort -n | head -n1 || true
}

# Debian's packages: buildah builds, mmdebstrap makes the base; umoci and runc unpack and
# run the archive in e2e/test_image.py.
ensure_tools() {
    local p missing=()
    for p in buildah mmdebstrap umoci runc; do command -v "$p" >/dev/null || missing+=("$p"); done
    ((${#missing[@]})) || return 0
    log "installing ${missing[*]} from Debian"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" 2>&1 | ts_stderr
}

# overlay when the kernel lets this process mount it, else vfs (slow: it copies every layer
# in full). Storage stays buildah's own (/var/lib/containers/storage). chroot isolation: RUN
# steps share the host's network (pip reaches PyPI as the host does; proxy variables pass
# through) and need no network plugins or nested namespaces.
choose_storage() {
    driver=${KVPILOT_BUILDAH_DRIVER:-}
    if [[ -z $driver ]]; then
        if probe_overlay; then driver=overlay; else driver=vfs; log "overlay refused: using vfs"; fi
    fi
    export BUILDAH="buildah --storage-driver $driver" BUILDAH_ISOLATION=chroot
}

probe_overlay() {
    local ctr rc=0
    ctr=$(buildah --storage-driver overlay from scratch 2>/dev/null) || return 1
    buildah --storage-driver overlay mount "$ctr" >/dev/null 2>&1 || rc=1
    buildah --storage-driver overlay rm "$ctr" >/dev/null 2>&1 || true
    return $rc
}

# Hash lines for: exactly what the Containerfile copies into target $3 (keep in step with its
# COPY lines: the engine image holds no operator code), the Containerfile and ignore file,
# these scripts (their flags shape the image), and $4.
inputs() {
    local repo=$1 here=$2 code=(engine kernels)
    [[ $3 == engine ]] || code+=(operator)
    (
        cd "$repo"
        {
            printf '%s\n' Containerfile .dockerignore pyproject.toml
            find "${code[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc'
            # Relative paths: the hash must not depend on where the clone is.
            find "${here#"$repo"/}" -maxdepth 1 -type f -name '*.sh'
        } | LC_ALL=C sort | tr '\n' '\0' | xargs -0 sha256sum
    )
    echo "$4"
}

# Older archives of this target beyond the newest $3, and the cached layers of earlier builds:
# buildah prints each step's image ("--> Using cache ID" or "--> ID"); each target's list is
# kept beside its archive, and untagged images that no target's last build printed are left
# from older inputs and would only fill the disk.
prune() {
    local cache=$1 target=$2 keep=$3 buildlog=$4 used id stale=()
    ls -1t "$cache"/kvpilot-"$target"-*.oci.tar 2>/dev/null | tail -n +$((keep + 1)) | xargs -r rm -f --
    grep -oE -- '^--> (Using cache )?[0-9a-f]{10,64}' "$buildlog" | grep -oE '[0-9a-f]{10,64}$' \
        > "$cache/kvpilot-$target.layers" || true
    used=$(cat "$cache"/kvpilot-*.layers 2>/dev/null || true)
    for id in $($BUILDAH images --all --no-trunc --filter dangling=true --format '{{.ID}}'); do
        id=${id#sha256:}
        grep -q "^${id:0:10}" <<<"$used" || stale+=("$id")
    done
    if ((${#stale[@]})); then
        log "removing ${#stale[@]} cached images of earlier builds"
        $BUILDAH rmi "${stale[@]}" >/dev/null 2>&1 || true
    fi
}

main "$@"
