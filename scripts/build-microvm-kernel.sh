#!/usr/bin/env bash
# Builds the microVM guest artifacts from Debian packages, as root, into the cache dir
# ($CPUOS_MICROVM_DIR, default $CPUOS_HOME/microvm, default /var/lib/cpuos/microvm) —
# never into the repo:
#   vmlinux         from linux-image-*-cloud-amd64 (apt-get download + dpkg-deb -x),
#                   uncompressed out of its vmlinuz (PVH direct boot)
#   initramfs.cpio  busybox-static + virtio-mmio modules (+ deps) + /init
# and records them in kernel/current.json. Cached by package versions and content.
# Also installs what the microVM backend runs with (QEMU, e2fsprogs).
# Usage: scripts/build-microvm-kernel.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "build-microvm-kernel: run as root" >&2
  exit 2
fi

need_pkgs=(qemu-system-x86 e2fsprogs lz4)
missing=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] || ! apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1; then
  apt-get update -q
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

py=.venv/bin/python
[ -x "$py" ] || py=python3
exec "$py" -m cpuosd.backends.microvm.guest_artifacts build "$@"
