#!/usr/bin/env bash
# Builds gVisor's runsc from the Go module pinned in deps/runsc/go.mod (gVisor's `go`
# branch, which builds with plain `go`), with cpuos's small changes to it
# (deps/runsc/patches/apply.py, given to `go build -overlay`), once, and installs it at
#   /usr/local/lib/cpuos/runsc-<version>+cpuos.<patch level>/runsc
# where cpuosd finds it (cpuosd.backends.runsc). Sources come only from the Go module
# proxy; go.sum pins their hashes. The module and build caches are kept, so a rebuild
# is quick and an installed binary is reused as is.
# Usage: scripts/build-runsc.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."

force=0
[ "${1:-}" = "--force" ] && force=1

version=$(grep -oE 'gvisor.dev/gvisor v[^ ]+' deps/runsc/go.mod | head -1 | cut -d' ' -f2)
[ -n "$version" ] || { echo "build-runsc: no gvisor.dev/gvisor version in deps/runsc/go.mod" >&2; exit 2; }
# the changes in deps/runsc/patches (keep in step with PATCH_LEVEL in cpuosd/backends/runsc.py)
patch_level=4
module_version=$version
version="$version+cpuos.$patch_level"
prefix=${CPUOS_RUNSC_PREFIX:-/usr/local/lib/cpuos}
dest="$prefix/runsc-$version"

if [ $force -eq 0 ] && [ -x "$dest/runsc" ] && "$dest/runsc" --version 2>/dev/null | grep -F "$version" >/dev/null; then
  echo "==> runsc $version already installed at $dest/runsc"
  exit 0
fi
command -v go >/dev/null || { echo "build-runsc: go is not installed (Go >= 1.26.3 is needed)" >&2; exit 2; }

echo "==> building runsc $version with $(go version | cut -d' ' -f3) (about 1.5 min on 2 cores; cached afterwards)"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOTOOLCHAIN=local
cd deps/runsc
go mod download gvisor.dev/gvisor
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
moddir=$(go list -m -f '{{.Dir}}' gvisor.dev/gvisor)
[ "$(go list -m -f '{{.Version}}' gvisor.dev/gvisor)" = "$module_version" ] || {
  echo "build-runsc: go.mod resolves gvisor.dev/gvisor to another version" >&2; exit 1; }
# a patched copy of the module, and a copy of this build module that uses it
python3 patches/apply.py "$moddir" "$tmp/gvisor"
mkdir "$tmp/build" "$tmp/build/precompile"
cp go.mod go.sum tools.go "$tmp/build/"
cp patches/precompile_seccomp.go.in "$tmp/build/precompile/main.go"
cd "$tmp/build"
go mod edit -replace "gvisor.dev/gvisor=$tmp/gvisor"
# the seccomp programs runsc installs at every boot, precompiled into it (as Bazel does)
echo "    precompiling seccomp programs"
go run ./precompile "$tmp/gvisor"
# -v names each package as it is compiled: count them as progress
set +e
go build -v -trimpath -o "$tmp/runsc" \
  -ldflags "-X gvisor.dev/gvisor/runsc/version.version=$version" \
  gvisor.dev/gvisor/runsc 2>&1 | {
    n=0
    while IFS= read -r line; do
      case "$line" in
        *" "*|*:*) echo "$line" ;;  # an error or a warning, not a package path
        *) n=$((n + 1)); [ $((n % 100)) -eq 0 ] && echo "    compiled $n packages" ;;
      esac
    done
    echo "    compiled $n packages"
  }
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || [ ! -x "$tmp/runsc" ]; then
  echo "build-runsc: go build failed (exit $rc)" >&2
  exit 1
fi
mkdir -p "$dest"
install -m 0755 "$tmp/runsc" "$dest/runsc.new"
mv -f "$dest/runsc.new" "$dest/runsc"
"$dest/runsc" --version | sed -n 1p  # (sed reads it all: head would close the pipe, and runsc die of SIGPIPE under pipefail)
echo "==> installed $dest/runsc"
