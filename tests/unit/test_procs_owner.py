"""cpuosd.procs is the one owner of the daemon's child processes (it registers each by its
pidfd before anything can reap it; cpuosd is a subreaper that reaps what is not registered).
No other module of cpuosd starts a process itself: no subprocess, no asyncio subprocess, no
os.fork/exec*/spawn*/system/popen/posix_spawn, no pty.fork, no multiprocessing."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from cpuosd import procs
from cpuosd.templates import stepbox
from support.daemon import wait_until

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "cpuosd"

MODULES = {"subprocess", "multiprocessing", "pty", "concurrent.futures.process"}
OS_CALLS = {"fork", "forkpty", "system", "popen", "spawnl", "spawnle", "spawnlp", "spawnlpe",
            "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
            "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe"}
ASYNCIO_CALLS = {"create_subprocess_exec", "create_subprocess_shell", "subprocess_exec",
                 "subprocess_shell"}
# (path under src/cpuosd, what) -> why it may
ALLOWED = {
    ("backends/microvm/jailer.py", "os.fork"):
        "the jailer runs as a program of its own (started through procs.spawn): it forks the "
        "VMM's process inside the namespaces it made",
    ("backends/microvm/jailer.py", "os.execve"):
        "the jailer's child becomes the VMM (in the jail, environment cleared)",
}


def process_starts(tree: ast.AST) -> list[tuple[str, int]]:
    """(what, line) of each import of a process-starting module and each use of a
    process-starting function of os or asyncio (called or referenced, e.g. passed on)."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names
                      if a.name in MODULES or a.name.split(".")[0] in MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            if node.module in MODULES or node.module.split(".")[0] in MODULES:
                found.append((node.module, node.lineno))
            elif node.module == "os":
                found += [(f"os.{a.name}", node.lineno) for a in node.names
                          if a.name in OS_CALLS]
            elif node.module == "asyncio":
                found += [(f"asyncio.{a.name}", node.lineno) for a in node.names
                          if a.name in ASYNCIO_CALLS]
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "os" \
                    and node.attr in OS_CALLS:
                found.append((f"os.{node.attr}", node.lineno))
            elif node.attr in ASYNCIO_CALLS:  # asyncio.create_subprocess_*, loop.subprocess_*
                found.append((f"asyncio.{node.attr}", node.lineno))
    return sorted(found, key=lambda f: f[1])


def test_only_procs_starts_processes() -> None:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "procs.py" or rel.startswith("e2b/gen/"):
            continue
        for what, line in process_starts(ast.parse(path.read_text(), str(path))):
            if (rel, what) not in ALLOWED:
                bad.append(f"src/cpuosd/{rel}:{line} ({what})")
    assert not bad, ("a process started outside cpuosd/procs.py (use procs.spawn, run or "
                     "run_sync: the child must be registered before anything can reap it): "
                     + ", ".join(bad))


def test_the_rule_sees_what_it_must() -> None:
    tree = ast.parse(
        "import subprocess\n"
        "from subprocess import run\n"
        "import os, multiprocessing.pool\n"
        "from os import fork, getpid\n"
        "import asyncio\n"
        "async def f(loop):\n"
        "    os.execvp('x', ['x'])\n"
        "    await asyncio.create_subprocess_exec('x')\n"
        "    await loop.subprocess_shell(None, 'x')\n"
        "    return os.getpid(), os.system\n")
    assert process_starts(tree) == [
        ("subprocess", 1), ("subprocess", 2), ("multiprocessing.pool", 3), ("os.fork", 4),
        ("os.execvp", 7), ("asyncio.create_subprocess_exec", 8), ("asyncio.subprocess_shell", 9),
        ("os.system", 10)]


def test_every_allowance_is_still_needed() -> None:
    used = set()
    for rel, what in ALLOWED:
        tree = ast.parse((SRC / rel).read_text())
        if any(w == what for w, _ in process_starts(tree)):
            used.add((rel, what))
    assert used == set(ALLOWED), set(ALLOWED) - used


PGRP = ["python3", "-c", "import os; print(os.getpgrp())"]


def test_run_sync_in_a_session_of_its_own_or_in_our_group() -> None:
    """Template build steps (stepbox) stay in the build's process group, which the daemon
    signals to end a build; other children lead a session of their own."""
    rc, out, _ = procs.run_sync(PGRP, timeout=60)
    assert rc == 0 and int(out) != os.getpgrp()
    rc, out, _ = procs.run_sync(PGRP, timeout=60, new_session=False)
    assert rc == 0 and int(out) == os.getpgrp()


def test_run_sync_kills_at_its_timeout() -> None:
    for new_session in (True, False):  # (not our group: only the child is killed)
        rc, _, _ = procs.run_sync(["sleep", "600"], timeout=0.1, new_session=new_session)
        assert rc == procs.KILLED


def test_a_build_step_streams_its_lines_in_the_build_group() -> None:
    lines: list[str] = []
    rc, tail = stepbox.stream(["sh", "-c", "echo one; echo two >&2; "
                               "python3 -c 'import os; print(os.getpgrp())'; exit 3"],
                              lines.append, tail=2)
    assert rc == 3
    assert lines[:2] == ["one", "two"] and int(lines[2]) == os.getpgrp()
    assert tail == lines[1:]


def test_wait_sync_waits_on_a_pidfd_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's wait_sync whose child another thread collects (reap_orphans) just before
    the wait begins, and whose pidfd number a new descriptor then takes, still waits on
    the child: on a descriptor of its own, not on whatever took the number."""
    import select

    child = procs.spawn(["sleep", "0.2"])
    real_poll = select.poll
    seen: list[str] = []

    class RacingPoll:
        def __init__(self) -> None:
            self.p = real_poll()

        def register(self, fd: int, mask: int) -> None:
            # (the race, made to happen here: the child ends, another thread collects it
            # and closes its pidfd, and the number goes to a new pipe)
            wait_until(lambda: _state(child.pid) in ("Z", "gone"), "the child to end", 10)
            procs.reap_orphans()
            r, w = os.pipe()
            pipes.extend((r, w))
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
            self.p.register(fd, mask)

        def poll(self, timeout: int | None = None) -> list[tuple[int, int]]:
            return self.p.poll(timeout)

    pipes: list[int] = []
    monkeypatch.setattr(select, "poll", RacingPoll)
    try:
        assert child.wait_sync(30) == 0
    finally:
        for fd in pipes:
            os.close(fd)
    assert seen == ["anon_inode:[pidfd]"], seen


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "gone"



# run in a process of its own (a subreaper: orphans below it come to it, which the test
# process must not become): prints what kill_orphans did, as JSON
ORPHANS = r"""
import json, os, sys
from cpuosd import procs
from support.daemon import wait_until

HOLD = "import signal; print('up', flush=True); signal.pause()"
MID = '''
import signal, subprocess, sys
for bundle in ("/b/mine", "/b/other"):
    p = subprocess.Popen([sys.executable, "-c", sys.argv[1], "--bundle=" + bundle],
                         start_new_session=True, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\\n"
    print(p.pid, flush=True)
signal.pause()
'''
assert procs.become_subreaper()
# a middle process starts two processes in sessions of their own and is killed: they are
# then our adopted orphans (as runsc's sandbox and gofer when runsc is killed half-way)
r, w = os.pipe()
mid = procs.spawn([sys.executable, "-c", MID, HOLD], stdout=w)
os.close(w)
with os.fdopen(r) as f:
    mine, other = int(f.readline()), int(f.readline())
mid.kill()
assert mid.wait_sync(10) is not None
wait_until(lambda: all(procs._ppid(p) == os.getpid() for p in (mine, other)), "adoption", 10)
# a registered child whose argv matches too
r, w = os.pipe()
reg = procs.spawn([sys.executable, "-c", HOLD, "--bundle=/b/mine"], stdout=w)
os.close(w)
with os.fdopen(r) as f:
    assert f.readline() == "up\n"

killed = procs.kill_orphans(lambda argv: b"--bundle=/b/mine" in argv)


def gone(pid):
    procs.reap_orphans()
    return not os.path.exists(f"/proc/{pid}")


wait_until(lambda: gone(mine), "the matching orphan to end", 10)
out = {"killed": killed, "mine": mine, "other_alive": not gone(other),
       "registered_alive": reg.returncode is None and not gone(reg.pid)}
procs.kill_orphans(lambda argv: True)
reg.kill()
assert reg.wait_sync(10) is not None
wait_until(lambda: gone(other), "the other orphan to end", 10)
print(json.dumps(out))
"""


def test_kill_orphans_ends_only_the_matching_adopted_orphans() -> None:
    """kill_orphans signals the adopted orphans whose argv matches: not another orphan,
    not a registered child whose argv matches too."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), str(REPO / "tests")])}
    r = subprocess.run([sys.executable, "-c", ORPHANS], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["killed"] == [out["mine"]]
    assert out["other_alive"] and out["registered_alive"]
