#!/usr/bin/env bash
# Installs what the tests need (as root) and runs them: unit tests, then the end-to-end
# suite against real daemons on real runsc. Slow suites are excluded (run them with
# `scripts/test.sh -m slow`). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev

# the microVM guest (kernel + initramfs from Debian packages): the TCG tests boot it
echo "==> microVM guest artifacts"
if ! bash scripts/build-microvm-kernel.sh; then
  echo "error: building the microVM guest artifacts failed (its TCG tests need them)" >&2
  exit 1
fi

echo "==> lint and types"
.venv/bin/ruff check .
.venv/bin/mypy

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-m "not slow and not kvm")
set +e
.venv/bin/python -m pytest tests "${args[@]}"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests for: ${args[*]}" >&2
  exit 1
fi
exit $rc
