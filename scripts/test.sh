#!/usr/bin/env bash
# Installs what the tests need (as root) and runs them: unit tests, then the end-to-end
# suite against real daemons on real runsc. Slow suites are excluded (run them with
# `scripts/test.sh -m slow`). Extra arguments go to pytest.
#
# `scripts/test.sh --fast`: tier 0 only, for the edit-test loop (no root, no runsc, no
# template, nothing installed; needs .venv): ruff, the unit tests and the component tests
# (the real daemon in process over the real agent as a local process, tests/component).
# The default run runs them too, with everything else.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fast" ]; then
  shift
  if [ ! -x .venv/bin/python ]; then
    echo "error: no .venv (python3 -m venv .venv && .venv/bin/pip install -e '.[dev]')" >&2
    exit 1
  fi
  .venv/bin/ruff check .
  exec .venv/bin/python -m pytest tests/unit tests/component -q --durations=5 "$@"
fi

bash scripts/setup.sh --dev

# the microVM guest (kernel + initramfs from Debian packages): the TCG tests boot it
echo "==> microVM guest artifacts"
if ! bash scripts/build-microvm-kernel.sh; then
  echo "error: building the microVM guest artifacts failed (its TCG tests need them)" >&2
  exit 1
fi

# etcd + kube-apiserver from the Go module proxy (~7.5 min once, cached by version): the
# Kubernetes tests of tests/cluster run against them
echo "==> etcd and kube-apiserver (scripts/build-k8s.sh, cached by version)"
if ! bash scripts/build-k8s.sh; then
  echo "error: building etcd/kube-apiserver failed (the tests of tests/cluster need them)" >&2
  exit 1
fi

# the browser template (chromium; ~45-125 s once, cached by content hash): the browser
# tests and the browser benchmark's smoke run need it; the demo (setup.sh) does not
echo "==> building the browser template (cached by content hash)"
.venv/bin/cpuosd template build browser
# the code-interpreter template (python's packages, its kernel warm in the snapshot; ~60 s
# once, cached): the interpreter tests and the run-code benchmark's smoke run need it
echo "==> building the code-interpreter template (cached by content hash)"
.venv/bin/cpuosd template build code-interpreter

echo "==> lint and types"
.venv/bin/ruff check .
.venv/bin/mypy

# bytecode compiled once: every test daemon, node and API process, CLI, bench script and E2B
# suite process imports src/ (~190 modules). Where PYTHONDONTWRITEBYTECODE is set (this
# machine's sessions set it) no process writes it and each compiled them all again: a test
# daemon took 1.7 s of CPU to /health instead of 1.1 s
.venv/bin/python -m compileall -q src tests/support bench >/dev/null

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-m "not slow and not kvm")
# tiers 1 and 2 on several workers (pytest-xdist; a test module stays on one worker, so its
# module-scoped daemons and testbeds are made once): each worker has its own daemons, homes
# and network slots, and the template cache is shared. Most tests wait on sandboxes more
# than they compute: more workers than cores (2 cores: with 2 workers the cores were 73-74 %
# busy and pytest took 11:29-11:41, with 3 90 % and 9:51). The longest modules go first
# (tests/conftest.py LONGEST_FIRST; xdist's reordering by test count is off).
# CPUOS_TEST_WORKERS=0 runs them in this process.
workers=${CPUOS_TEST_WORKERS:-3}
set +e
.venv/bin/python -m pytest tests -n "$workers" --dist loadfile --no-loadscope-reorder \
  --durations=25 "${args[@]}"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests for: ${args[*]}" >&2
  exit 1
fi

# the TypeScript SDK: its generated types' staleness check, unit tests, npm pack, and its
# end-to-end tests against a real daemon (sdk/js/test/daemon.py, through .venv)
echo "==> TypeScript SDK (sdk/js): npm ci && npm test"
js_rc=0
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if [ "$node_major" -ge 20 ] && command -v npm >/dev/null; then
  (cd sdk/js && npm ci --no-audit --no-fund && CPUOS_PYTHON="$PWD/../../.venv/bin/python" npm test) \
    || js_rc=$?
elif [ "${CI:-}" = "true" ]; then
  echo "error: the TypeScript SDK's tests need node >= 20 and npm (found node major" \
       "'$node_major'); in CI they must run" >&2
  js_rc=1
else
  echo "skipped: the TypeScript SDK's tests (sdk/js) need node >= 20 and npm (found node" \
       "major '$node_major')" >&2
fi
[ $rc -ne 0 ] && exit $rc
exit $js_rc
