#!/usr/bin/env bash
# Builds the Kubernetes test bed of the cluster tests (tests/cluster): kube-apiserver from
# the k8s.io/kubernetes Go module and etcd from go.etcd.io/etcd/server/v3, pinned in
# deps/k8s/{apiserver,etcd}/go.mod (go.sum pins their hashes; the staging modules of
# k8s.io/kubernetes are replaced with their published v0.x there), once, and installs them at
#   /usr/local/lib/cpuos/kubernetes-<version>/kube-apiserver
#   /usr/local/lib/cpuos/etcd-<version>/etcd
# where the tests find them (tests/support/testbed.py). Sources come only from the Go module
# proxy. About 7.5 min on 2 idle cores the first time; an installed binary whose --version
# matches is reused as is (scripts/build-runsc.sh does the same for runsc).
# Usage: scripts/build-k8s.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."

force=0
[ "${1:-}" = "--force" ] && force=1

k8s_version=$(grep -oE 'k8s.io/kubernetes v[^ ]+' deps/k8s/apiserver/go.mod | head -1 | cut -d' ' -f2)
etcd_version=$(grep -oE 'go.etcd.io/etcd/server/v3 v[^ ]+' deps/k8s/etcd/go.mod | head -1 | cut -d' ' -f2)
[ -n "$k8s_version" ] && [ -n "$etcd_version" ] || {
  echo "build-k8s: no k8s.io/kubernetes or etcd version in deps/k8s/*/go.mod" >&2; exit 2; }
prefix=${CPUOS_K8S_PREFIX:-/usr/local/lib/cpuos}
apiserver="$prefix/kubernetes-$k8s_version/kube-apiserver"
etcd="$prefix/etcd-$etcd_version/etcd"

export CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOTOOLCHAIN=local

# build <module dir> <package> <destination> <ldflags>
build() {
  local dir=$1 pkg=$2 dest=$3 ldflags=$4 tmp rc
  command -v go >/dev/null || { echo "build-k8s: go is not installed (Go >= 1.26 is needed)" >&2; exit 2; }
  tmp=$(mktemp -d)
  # (-v names each package as it is compiled: counted as progress)
  set +e
  (cd "$dir" && go build -v -trimpath -o "$tmp/out" -ldflags "$ldflags" "$pkg") 2>&1 | {
    n=0
    while IFS= read -r line; do
      case "$line" in
        *" "*|*:*) echo "$line" ;;  # an error or a warning, not a package path
        *) n=$((n + 1)); [ $((n % 200)) -eq 0 ] && echo "    compiled $n packages" ;;
      esac
    done
    echo "    compiled $n packages"
  }
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ] || [ ! -x "$tmp/out" ]; then
    rm -rf "$tmp"
    echo "build-k8s: go build $pkg failed (exit $rc)" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$dest")"
  install -m 0755 "$tmp/out" "$dest.new"
  mv -f "$dest.new" "$dest"
  rm -rf "$tmp"
}

if [ $force -eq 0 ] && [ -x "$etcd" ] && "$etcd" --version 2>/dev/null | grep -F "etcd Version: ${etcd_version#v}" >/dev/null; then
  echo "==> etcd $etcd_version already installed at $etcd"
else
  echo "==> building etcd $etcd_version with $(go version | cut -d' ' -f3) (about 1.5 min on 2 cores; cached afterwards)"
  build deps/k8s/etcd go.etcd.io/etcd/server/v3 "$etcd" "-s -w"
  "$etcd" --version | sed -n 1p
  echo "==> installed $etcd"
fi

if [ $force -eq 0 ] && [ -x "$apiserver" ] && "$apiserver" --version 2>/dev/null | grep -xF "Kubernetes $k8s_version" >/dev/null; then
  echo "==> kube-apiserver $k8s_version already installed at $apiserver"
else
  minor=${k8s_version#v1.}; minor=${minor%%.*}
  echo "==> building kube-apiserver $k8s_version with $(go version | cut -d' ' -f3) (about 6 min on 2 cores; cached afterwards)"
  build deps/k8s/apiserver k8s.io/kubernetes/cmd/kube-apiserver "$apiserver" \
    "-s -w -X k8s.io/component-base/version.gitVersion=$k8s_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  "$apiserver" --version
  echo "==> installed $apiserver"
fi
