#!/usr/bin/env bash
# Installs everything cpuos needs on a Debian 12 machine, as root, idempotently:
# Debian packages (mmdebstrap, QEMU, and Debian's 2022 runsc, kept only as a fallback and
# for the side-by-side benchmark), the runsc the project builds from the pinned gVisor Go
# module (scripts/build-runsc.sh, cached), a virtualenv in .venv with cpuos installed
# (editable, with dev tools when --dev), and the `python` template.
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
[ "${1:-}" = "--dev" ] && dev=1

if [ "$(id -u)" -ne 0 ]; then
  echo "setup: run as root (runsc, mmdebstrap and cgroups need it)" >&2
  exit 2
fi

need_pkgs=(runsc mmdebstrap iproute2 nftables python3 python3-venv python3-pip ca-certificates procps
           qemu-system-x86 busybox-static cpio lz4 e2fsprogs zstd xz-utils tmux)
# --dev: nginx, the front proxy the preview tests start on loopback (tests/security), and
# chromium, the browser the web console's tests drive headless (tests/e2e/test_console_ui.py);
# postgresql, the server the cluster tests start on loopback (tests/cluster, by pid)
[ $dev -eq 1 ] && need_pkgs+=(nginx chromium postgresql)
missing=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> apt-get install ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  if [[ " ${missing[*]} " == *" nginx "* ]] && command -v systemctl >/dev/null \
     && systemctl is-system-running >/dev/null 2>&1; then
    systemctl disable --now nginx >/dev/null 2>&1 || true  # tests start their own, by pid
  fi
  if [[ " ${missing[*]} " == *" postgresql "* ]] && command -v systemctl >/dev/null \
     && systemctl is-system-running >/dev/null 2>&1; then
    systemctl disable --now postgresql >/dev/null 2>&1 || true  # (the same)
  fi
fi

if ! bash scripts/build-runsc.sh; then
  echo "WARNING: building runsc failed (see above); cpuosd falls back to Debian's 2022" \
       "runsc on ptrace, 4-11x slower, and says so at start-up" >&2
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  python3 -m venv .venv
fi
extra="server"
[ $dev -eq 1 ] && extra="dev"
# with uv (from PyPI, into the venv): it resolves and installs the ~100 distributions of
# .[dev] in seconds where pip takes ~40 s on every fresh clone (CI's); pip if uv is not to be
# had. uv reads neither pip's configuration nor its CA: the system's CAs (--native-tls) and
# pip's index and find-links, when set, are passed on
echo "==> installing cpuos into .venv (-e .[$extra])"
uv_args=(--python .venv/bin/python --native-tls)
[ -n "${PIP_INDEX_URL:-}" ] && uv_args+=(--index-url "$PIP_INDEX_URL")
[ -n "${PIP_FIND_LINKS:-}" ] && [ -d "${PIP_FIND_LINKS}" ] && uv_args+=(--find-links "$PIP_FIND_LINKS")
if .venv/bin/python -m pip install -q uv >/dev/null 2>&1 \
   && .venv/bin/uv pip install -q "${uv_args[@]}" -e ".[$extra]"; then
  :
else
  echo "==> uv unavailable or failed: pip install -e .[$extra]"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[$extra]"
fi

# the web console (/ui): built from console/ with npm (Vite) into the package, when its
# sources changed (a hash of them is stamped into the bundle; tests/unit/test_console_bundle.py)
if node -e 'const [a,b]=process.versions.node.split(".").map(Number);process.exit(a>20||(a==20&&b>=19)?0:1)' \
    2>/dev/null && command -v npm >/dev/null; then
  if ! node console/scripts/stamp.mjs --check >/dev/null 2>&1; then
    echo "==> building the web console (console/: npm ci && npm run build)"
    (cd console && npm ci --no-audit --no-fund && npm run build)
  fi
elif [ "${CI:-}" = "true" ]; then
  echo "error: building the web console needs node >= 20.19 and npm" >&2
  exit 1
else
  echo "WARNING: the web console is not built (it needs node >= 20.19 and npm); /ui says so," \
       "the API and SDKs work without it" >&2
fi

echo "==> building the python template (cached by content hash)"
.venv/bin/cpuosd template build python
