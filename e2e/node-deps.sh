#!/usr/bin/env bash
# The Debian packages the local cluster's node and `make image` need, installed if missing:
#   runc                 the OCI runtime containerd's shim runs containers with
#   iptables, conntrack  kube-proxy's Service rules (and its conntrack clean-up)
#   buildah, mmdebstrap, umoci   `make image` (e2e/image/build.sh) and its test
# Everything else the node runs is built from Go modules (e2e/k8s, containerd, cni, ...).
set -euo pipefail
need=()
for pkg_cmd in runc:runc iptables:iptables conntrack:conntrack buildah:buildah mmdebstrap:mmdebstrap umoci:umoci; do
    command -v "${pkg_cmd#*:}" >/dev/null || need+=("${pkg_cmd%%:*}")
done
((${#need[@]})) || exit 0
if [[ $(id -u) != 0 ]]; then
    echo "the local cluster needs these Debian packages: ${need[*]} (run as root to install them)" >&2
    exit 1
fi
echo "[node-deps] installing ${need[*]} from Debian" >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2 \
  || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2; }
