"""An idle sandbox costs nothing (issue 22; auto-pause on idle is test_idle.py's): with
no command running and no stream open, nothing inside wakes up on a timer (the agent, its
spawner, what the template starts), so the sandbox's host cgroup uses (next to) no CPU;
the agent's OOM guard sleeps until the host says the sandbox's memory is high, and still
ends a runaway left behind by a command.

The figures (host CPU and memory per idle sandbox beside raw runsc) are the density
benchmark's (bench/cases/density.py); these tests assert behaviour: a quiet window exists,
and what runs inside is the agent and its spawner alone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cpuos import Sandbox
from cpuosd.templates.builder import template_info
from support.daemon import TEMPLATES, Daemon, wait_until

pytestmark = pytest.mark.e2e

WINDOW = 5.0  # s
# CPU the whole sandbox (sentry, gofer, agent) may use in a window and count as quiet: 0.5 %
# of a core. Before this work an idle python sandbox used 2 % (its agent's memory guard woke
# every 50 ms, its reaper every 0.5 s), with the kernel 2.5 %: a poll loop fails this. The
# issue's 0.2 % is the density bench's figure on a quiet host (bench/cases/density.py); the
# tests run on several workers, where a sandbox's few idle wakeups cost more (11.3 ms in
# 5 s seen once beside another worker).
QUIET = 0.005 * WINDOW


def _cpu(s: Sandbox) -> float:
    return float(s.metrics()["cpu_seconds"])


def quiet_window(s: Sandbox, attempts: int = 6) -> float:
    """The least CPU (s) the sandbox used in one of ``attempts`` windows of WINDOW s (the
    first may still hold the end of the last command); stops at the first quiet one."""
    least = float("inf")
    for _ in range(attempts):
        c0 = _cpu(s)
        time.sleep(WINDOW)  # the measurement itself: nothing is waited for
        least = min(least, _cpu(s) - c0)
        if least <= QUIET:
            break
    return least


def _processes(s: Sandbox) -> list[tuple[int, int, str]]:
    """(pid, threads, command line) of every process inside but ps itself."""
    out = s.exec(["ps", "-eo", "pid=,nlwp=,args="]).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if line.strip()]
    return [(int(p), int(n), a) for p, n, a in rows if not a.startswith("ps ")]


def _host_memory_events(sid: str) -> bool:
    return Path(f"/sys/fs/cgroup/memory/cpuos/{sid}/cgroup.event_control").exists()


def test_an_idle_python_sandbox_makes_no_wakeups(sbx: Sandbox) -> None:
    assert sbx.exec("true").exit_code == 0
    procs = _processes(sbx)
    # the agent and its spawner, nothing else (the template starts nothing); the agent's
    # threads: the one serving the host, its reaper, its OOM guard, its spawner's reader
    # and idle timer (+ the exec thread of the ps just run); the spawner's: its own and
    # its reaper
    assert [a for _, _, a in procs] == ["/usr/bin/python3 -s -m cpuos_agent"] * 2, procs
    assert sum(n for _, n, _ in procs) <= 8, procs
    used = quiet_window(sbx)
    tasks = sbx.metrics().get("pids")
    print(f"idle python sandbox: {used * 1e3:.2f} ms of CPU in {WINDOW:.0f} s; "
          f"{len(procs)} processes, {sum(n for _, n, _ in procs)} threads inside; "
          f"{tasks} host tasks")
    assert used <= QUIET, f"{used * 1e3:.1f} ms of CPU in a {WINDOW:.0f} s idle window"


def test_a_process_left_running_costs_no_guard_wakeups(sbx: Sandbox) -> None:
    """A server or kernel left behind (nohup ... &) used to keep the agent's OOM guard
    looking every 50 ms; with the host watching the sandbox's memory it sleeps."""
    if not _host_memory_events(sbx.id):
        pytest.skip("the host has no memory threshold events (cgroup v1's "
                    "cgroup.event_control): the agent's guard looks while anything runs")
    sbx.exec("nohup sleep 600 >/dev/null 2>&1 &")
    used = quiet_window(sbx)
    assert used <= QUIET, f"{used * 1e3:.1f} ms of CPU in a {WINDOW:.0f} s window"


BALLOON = ("x = []\n"
           "while True:\n"
           "    b = bytearray(8 << 20)\n"
           "    for i in range(0, len(b), 4096): b[i] = 1\n"
           "    x.append(b)\n")


def test_a_balloon_left_behind_is_ended_on_the_hosts_word(daemon: Daemon) -> None:
    """No command of the host's runs while the left-over balloon grows (the test watches
    it through the files API, not exec): the agent's guard wakes because the host said the
    sandbox's memory is high, and ends it at the sandbox's limit; the sandbox lives on."""
    s = Sandbox.create(template="python", timeout="5m", memory="256MiB",
                       **daemon.sdk_kwargs())
    try:
        if not _host_memory_events(s.id):
            pytest.skip("the host has no memory threshold events (cgroup v1)")
        s.files.write("/work/balloon.py", BALLOON)
        pid = int(s.exec("nohup python3 /work/balloon.py >/dev/null 2>&1 & echo $!").stdout)
        wait_until(lambda: not s.files.exists(f"/proc/{pid}"),
                   "the left-over balloon to be ended", 120)
        assert s.exec("echo alive").stdout == "alive\n"
        assert s.info().state == "running"
    finally:
        s.kill()
        s.close()


def test_an_idle_code_interpreter_stays_quiet(daemon: Daemon) -> None:
    """Its kernel and driver are resident, yet idle they (and the agent's guard) do not
    spin: the sandbox stays under the idle budget."""
    if template_info(TEMPLATES, "code-interpreter") is None:
        pytest.skip(f"the code-interpreter template is not built in {TEMPLATES} "
                    "(scripts/test.sh builds it)")
    s = Sandbox.create(template="code-interpreter", timeout="10m", **daemon.sdk_kwargs())
    try:
        if not _host_memory_events(s.id):
            pytest.skip("the host has no memory threshold events (cgroup v1)")
        assert s.run_code("1+1").text == "2"
        used = quiet_window(s)
        assert used <= QUIET, f"{used * 1e3:.1f} ms of CPU in a {WINDOW:.0f} s window"
    finally:
        s.kill()
        s.close()


@pytest.mark.parametrize("fresh_daemon", [{"CPUOS_SPAWNER_IDLE_EXIT": "2"}], indirect=True)
def test_an_idle_sandbox_lets_its_spawner_go(fresh_daemon: Daemon) -> None:
    """Nothing run for a while (CPUOS_SPAWNER_IDLE_EXIT: 2 s here, 120 by default): the
    spawner exits (the files API lists /proc without starting anything), leaving the agent
    alone; the next command forks a new one and runs."""
    sbx = Sandbox.create(template="python", timeout="5m", **fresh_daemon.sdk_kwargs())
    assert sbx.exec("true").exit_code == 0

    def processes() -> int:
        return sum(1 for e in sbx.files.list("/proc") if e.name.isdigit())

    try:
        wait_until(lambda: processes() == 1, "the spawner to exit", 60)
        r = sbx.exec("echo $PPID; exit 3")
        assert r.exit_code == 3 and r.stdout.strip() not in ("", "1"), r
        assert processes() == 2
    finally:
        sbx.kill()
        sbx.close()


def test_a_restored_sandbox_holds_no_more_host_tasks_than_one_booted_cold(
        fresh_daemon: Daemon) -> None:
    """What a restore leaves behind in the host: gVisor read the memory image with 128 reads
    at once, each holding a host thread that the Go runtime keeps, so an idle python
    sandbox restored from its template held ~30 more host tasks (and ~5 MiB more of the
    Sentry's memory) than the same sandbox booted cold. cpuos's runsc (patch level 4) reads
    with 4 at most: the two hold about as many."""
    kw = fresh_daemon.sdk_kwargs()
    restored = Sandbox.create(template="python", timeout="5m", **kw)
    cold = Sandbox.create(template="python", timeout="5m", memory="1GiB", **kw)  # (a size
    # other than the template's boots cold)
    try:
        log = fresh_daemon.log.read_text()
        assert f"restore of {restored.id}" in log and f"boot of {cold.id}" in log
        for s in (restored, cold):
            assert s.exec("true").exit_code == 0
        tasks = {name: s.metrics()["pids"] for name, s in (("restored", restored),
                                                           ("cold", cold))}
        print(f"host tasks: {tasks}")
        assert tasks["restored"] <= tasks["cold"] + 6, tasks
    finally:
        for s in (restored, cold):
            s.kill()
            s.close()
