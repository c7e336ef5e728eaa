#!/usr/bin/env bash
# The main job: set up, start cpuosd (if it is not already up) and run examples/quickstart.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

export CPUOS_HOME="${CPUOS_HOME:-/var/lib/cpuos}"
url="http://${CPUOS_HOST:-127.0.0.1}:${CPUOS_PORT:-7770}"
if ! .venv/bin/python -c "import httpx,sys; httpx.get('$url/health', timeout=1)" 2>/dev/null; then
  mkdir -p "$CPUOS_HOME"
  echo "==> starting cpuosd on $url (log: $CPUOS_HOME/cpuosd.log)"
  # the log rotates by size (CPUOS_LOG_MAX_BYTES, CPUOS_LOG_BACKUPS); cpuosd.out keeps only
  # what is printed outside the log (a crash at start-up)
  CPUOS_LOG_FILE="$CPUOS_HOME/cpuosd.log" setsid nohup .venv/bin/cpuosd \
    >>"$CPUOS_HOME/cpuosd.out" 2>&1 </dev/null &
  echo $! >"$CPUOS_HOME/cpuosd.pid"
  for _ in $(seq 1 100); do
    .venv/bin/python -c "import httpx; httpx.get('$url/health', timeout=1)" 2>/dev/null && break
    sleep 0.1
  done
fi
echo "==> cpuosd is up (stop it with: kill \$(cat $CPUOS_HOME/cpuosd.pid))"
echo "==> python examples/quickstart.py"
.venv/bin/python examples/quickstart.py
