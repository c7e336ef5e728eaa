"""The agent is resident in every sandbox: what it imports at start is memory every idle
sandbox holds (issue 22). Modules only some requests need (tarfile and the archive code,
subprocess, a microVM's ipaddress) are imported when asked, not at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ON_DEMAND = ["tarfile", "cpuos_agent.tarx", "subprocess", "hashlib", "secrets", "platform",
             "cpuos_agent.messages",  # (types only: imported when type-checking)
             "ipaddress"]


def _agent_python(code: str, *args: str) -> str:
    """stdout of ``code`` run by a fresh interpreter as the agent's (-s, only src/)."""
    return subprocess.run([sys.executable, "-s", "-c", code, *args], capture_output=True,
                          text=True, check=True, env={"PYTHONPATH": str(SRC)}).stdout


def test_the_agent_loads_archive_and_process_modules_only_when_asked() -> None:
    code = ("import sys, cpuos_agent.agent; "
            f"print(sorted(m for m in {ON_DEMAND!r} if m in sys.modules))")
    out = _agent_python(code)
    assert out.strip() == "[]", out


HOLES = """
import sys
from cpuos_agent.memguard import give_back

def anon_kib():
    with open('/proc/self/status') as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith('RssAnon:'))

# 40 MB of heap blocks (1000 bytes: malloc's, not Python's small-object arenas); every
# hundredth kept, so what is freed is holes that glibc does not give back by itself
blocks = [bytes(1000) for _ in range(40_000)]
kept = blocks[::100]
del blocks
before = anon_kib()
give_back()
print(before, anon_kib())
"""


def test_give_back_returns_the_agents_free_heap() -> None:
    """What the agent calls as the sandbox goes idle and before a checkpoint: free heap in
    holes between live blocks goes back (to gVisor, which releases the pages)."""
    before, after = map(int, _agent_python(HOLES).split())
    assert after < before - 20_000, (before, after)  # KiB: of ~39 MB freed


ARENAS = """
import ctypes, sys, threading
from cpuos_agent.memguard import one_arena

if sys.argv[1] == "one":
    one_arena()
libc = ctypes.CDLL(None)
alive = threading.Barrier(5)

def thread():  # (mallocs while the others live: glibc would give each an arena)
    blocks = [bytes(5000) for _ in range(200)]
    alive.wait()
    alive.wait()

ts = [threading.Thread(target=thread) for _ in range(4)]
for t in ts:
    t.start()
alive.wait()
buf, size = ctypes.c_char_p(), ctypes.c_size_t()
libc.open_memstream.restype = ctypes.c_void_p
fp = ctypes.c_void_p(libc.open_memstream(ctypes.byref(buf), ctypes.byref(size)))
libc.malloc_info(0, fp)
libc.fclose(fp)
alive.wait()
print(buf.value.decode().count("<heap nr="))
"""


def test_the_agents_threads_share_one_malloc_arena() -> None:
    assert int(_agent_python(ARENAS, "default")) > 1  # (glibc's own way: the check
    # below can fail)
    assert int(_agent_python(ARENAS, "one")) == 1
