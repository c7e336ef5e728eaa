"""Streamed stdin for foreground execs (flow control end to end: the daemon's memory stays
bounded whatever the producer's and the consumer's speeds), and the liveness rule: a client
streaming from a sandbox that stops answering gets Unavailable, never a hang; once the
sandbox answers again its background commands are still there to reattach to."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator

import pytest

from cpuos import Sandbox, Unavailable
from support.daemon import Daemon, wait_until

pytestmark = pytest.mark.e2e

MIB = 1 << 20


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class _Peak:
    """The highest RSS of a process while it is watched."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, _rss_kib(pid), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_kib(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def test_streamed_stdin_100mib_through_a_slow_reader(daemon: Daemon, sbx: Sandbox) -> None:
    assert daemon.proc is not None
    block = os.urandom(MIB)
    want = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        for i in range(100):
            b = i.to_bytes(4, "big") + block[4:]
            want.update(b)
            yield b

    sbx.exec("true")
    before = _rss_kib(daemon.proc.pid)
    peak = _Peak(daemon.proc.pid)
    # the reader starts late: the producer is held back by the window, not buffered
    r = sbx.exec("sleep 1; sha256sum", stdin=chunks())
    top = peak.stop()
    assert r.exit_code == 0, r
    assert r.stdout.split()[0] == want.hexdigest()
    assert top - before < 48 * 1024, f"daemon RSS grew {top - before} KiB for 100 MiB"


def test_streamed_stdin_is_interactive(sbx: Sandbox) -> None:
    """Each line's answer comes back while stdin is still open (a REPL fed line by line)."""
    answered = threading.Event()
    seen: list[str] = []

    def on_stdout(text: str) -> None:
        seen.append(text)
        answered.set()

    def lines() -> Iterator[bytes]:
        for word in ("alpha", "beta", "gamma"):
            answered.clear()
            yield (word + "\n").encode()
            assert answered.wait(60), f"no answer to {word} while stdin was open"

    r = sbx.exec(["python3", "-u", "-c",
                  "import sys\nfor l in sys.stdin: print(l.strip().upper(), flush=True)"],
                 stdin=lines(), on_stdout=on_stdout)
    assert r.exit_code == 0 and r.stdout == "ALPHA\nBETA\nGAMMA\n", r

    # a command that stops reading early: the exec ends with its own status
    r = sbx.exec("head -c 5", stdin=(b"x" * 65536 for _ in range(64)))
    assert (r.exit_code, r.stdout) == (0, "xxxxx")


def _sandbox_pids(d: Daemon, sandbox_id: str) -> list[int]:
    """The runsc sandbox process of sandbox_id and all its descendants."""
    out = subprocess.run([d.runsc, "--root", str(d.runsc_root), "state", sandbox_id],
                         check=True, capture_output=True, text=True).stdout
    root = int(json.loads(out)["pid"])
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    pids, todo = [], [root]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(kids.get(p, []))
    return pids


@pytest.mark.parametrize("fresh_daemon", [{"CPUOS_POOL_SIZE": "0",
                                           "CPUOS_AGENT_LIVENESS": "2"}], indirect=True)
def test_frozen_sandbox_gives_unavailable_then_reattach(fresh_daemon: Daemon) -> None:
    d = fresh_daemon
    sbx = Sandbox.create(template="python", timeout="10m", **d.sdk_kwargs())
    pids: list[int] = []
    try:
        bg = sbx.exec("echo up; sleep 600", background=True)
        errors: dict[str, BaseException | None] = {}
        started = threading.Event()

        def follow() -> None:
            try:
                sbx.commands.connect(bg.pid, on_stdout=lambda _: started.set()).wait()
                errors["follow"] = None
            except BaseException as e:
                errors["follow"] = e

        def foreground() -> None:
            try:
                sbx.exec("sleep 600")
                errors["exec"] = None
            except BaseException as e:
                errors["exec"] = e

        threads = [threading.Thread(target=follow), threading.Thread(target=foreground)]
        for t in threads:
            t.start()
        assert started.wait(60)
        wait_until(lambda: sbx.exec("pgrep -c -x sleep").stdout.strip() == "2",
                   "both sleeping")
        pids = _sandbox_pids(d, sbx.id)
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        for t in threads:
            t.join(120)  # the liveness bound is 2 s: far less than this
            assert not t.is_alive(), "a client still hangs on a frozen sandbox"
        for what in ("follow", "exec"):
            e = errors[what]
            assert isinstance(e, Unavailable), (what, e)
            assert "stopped answering" in str(e), (what, e)
    finally:
        for p in pids:
            os.kill(p, signal.SIGCONT)
    try:
        # it answers again: the background command lives, and can be reattached
        def answers() -> bool:
            try:
                return sbx.exec("true").ok
            except Unavailable:
                return False

        wait_until(answers, "the agent is back")
        h = sbx.commands.connect(bg.pid)
        assert h.info().running
        out, _ = h.output()
        assert out == b"up\n"
        h.kill()
        assert h.wait().signal == signal.SIGKILL
    finally:
        sbx.kill()
        sbx.close()
