#!/usr/bin/env bash
# Builds the local cluster's Kubernetes binaries (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, and the node's kubelet and
# kube-proxy) from the Go module proxy
# with this wrapper module, once per machine, into
#   ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/k8s/<version>/bin
# Prints the bin folder on stdout as its last line; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")"
source ../gobuild.sh
VERSION=$(cat VERSION)
BINARIES="etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy"
gobuild_ready k8s "$VERSION" "$BINARIES" && exit 0
minor=${VERSION#v1.}; minor=${minor%%.*}
build_date=$(go list -m -f '{{.Time.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes 2>/dev/null \
  || echo 1970-01-01T00:00:00Z)
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done
gobuild k8s "$VERSION" "$BINARIES" "" "$ldflags" \
  ./cmd/etcd k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl \
  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
