"""cpuos quickstart: run model-written code in a disposable sandbox and fetch its output.

    python examples/quickstart.py

Talks to the local daemon (http://127.0.0.1:7770, key from /var/lib/cpuos/admin.key)
unless CPUOS_API_URL / CPUOS_API_KEY say otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cpuos import Sandbox

# What a model might write when asked to "plot a damped oscillation and summarise it".
MODEL_CODE = '''
import numpy as np
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

t = np.linspace(0, 10, 500)
y = np.exp(-0.3 * t) * np.cos(2 * np.pi * t)
print(f"samples: {t.size}, peak: {y.max():.3f}, final: {y[-1]:+.4f}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(t, y)
ax.set_title("damped oscillation")
fig.tight_layout()
fig.savefig("/work/chart.png", dpi=100)
print("wrote /work/chart.png")
'''


def main() -> int:
    with Sandbox.create(template="python", timeout="15m") as sbx:
        print(f"sandbox {sbx.id} is running")
        sbx.files.write("/work/main.py", MODEL_CODE)
        run = sbx.exec("python /work/main.py", timeout="2m",
                       on_stdout=lambda s: print("  stdout:", s, end=""),
                       on_stderr=lambda s: print("  stderr:", s, end="", file=sys.stderr))
        result = {"exit_code": run.exit_code, "stdout": run.stdout[-4000:],
                  "stderr": run.stderr[-2000:]}
        print(f"exit code {result['exit_code']} in {run.duration:.2f}s")
        if run.exit_code != 0:
            return 1
        chart = sbx.files.read("/work/chart.png")
        out = Path("chart.png")
        out.write_bytes(chart)
        print(f"fetched {len(chart)} bytes of PNG -> {out.resolve()}")
    print("sandbox killed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
