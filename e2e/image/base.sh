#!/usr/bin/env bash
# Makes the base image for the Containerfile from Debian's own packages, so no container
# registry is needed: mmdebstrap writes a minimal bookworm root filesystem as a tarball and
# buildah turns it into the local image localhost/kvpilot/base:bookworm-<hash>. The hash
# covers this file (suite, mirrors, packages, options): the image is made once and reused
# until this file changes. Prints the image's name as the last line of stdout.
#
# Usage: e2e/image/base.sh [full|slim|runtime]   (root; run by e2e/image/build.sh with BUILDAH set)
#   full     the engine image's base (a C compiler for Triton), the default
#   slim     where the operator image's virtualenv is made: the interpreter and python3-venv
#   runtime  the operator image itself: the interpreter and CA certificates only
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/lib.sh"

SUITE=bookworm
MIRRORS=(
    "deb http://deb.debian.org/debian $SUITE main"
    "deb http://deb.debian.org/debian $SUITE-updates main"
    "deb http://deb.debian.org/debian-security $SUITE-security main"
)
# What the virtualenv needs at run time, and to be made in the Containerfile's build stage:
# python3 + python3-venv (the interpreter and `python3 -m venv`), ca-certificates (TLS to
# Hugging Face, Kubernetes, Prometheus), and gcc + libc6-dev + python3-dev because Triton
# compiles its small C launcher stubs with the system compiler against Python.h the first
# time a kernel runs on a GPU.
variant=${1:-full}
case $variant in
    full) PACKAGES=python3,python3-venv,ca-certificates,gcc,libc6-dev,python3-dev ;;
    slim) PACKAGES=python3,python3-venv,ca-certificates ;;
    runtime) PACKAGES=python3,ca-certificates ;;
    *) log "unknown base variant $variant (full, slim or runtime)"; exit 1 ;;
esac
# Documentation, man pages and translations are never read in a container (as Debian's
# own "slim" images do); copyright files stay.
DPKG_OPTS=(
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-include=/usr/share/locale/locale.alias'
)

hash=$( (sha256sum < "${BASH_SOURCE[0]}"; echo "$variant") | sha256sum | cut -c1-12)  # of the content: not the clone's path
image=localhost/kvpilot/base:$SUITE-$variant-$hash
buildah=${BUILDAH:-buildah}

if $buildah inspect --type image "$image" >/dev/null 2>&1; then
    log "base image $image is up to date"
    echo "$image"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/kvpilot-base.XXXXXX")
ctr=""
cleanup() {
    [[ -n $ctr ]] && $buildah rm "$ctr" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

log "making $image with mmdebstrap ($SUITE, minbase: $PACKAGES)"
# --skip=output/dev: no device nodes in the tarball; the container runtime makes /dev.
# The merged-usr hook lays out /usr itself, so the usrmerge package (and the perl it pulls in,
# about 50 MB) is not installed.
mmdebstrap --variant=minbase --mode=root --format=tar --skip=output/dev \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include="$PACKAGES" "${DPKG_OPTS[@]}" \
    "$SUITE" "$work/rootfs.tar" "${MIRRORS[@]}" 2>&1 | ts_stderr
log "root filesystem: $(du -h "$work/rootfs.tar" | cut -f1)"

ctr=$($buildah from scratch)
$buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
$buildah config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --cmd /bin/bash \
    --label org.opencontainers.image.description="Debian $SUITE minbase with $PACKAGES" \
    "$ctr"
$buildah commit --quiet --rm "$ctr" "$image" >/dev/null
ctr=""
# Older bases are no longer referenced by anything this script makes.
$buildah images --format '{{.Name}}:{{.Tag}}' | grep "^localhost/kvpilot/base:$SUITE-$variant-" \
    | grep -vx "$image" | xargs -r $buildah rmi >/dev/null 2>&1 || true
log "base image $image made"
echo "$image"
