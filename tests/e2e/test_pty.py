"""Terminals: a real pseudo-terminal inside, driven from the SDK (size, resize, tty, ^C,
full-screen programs, detach and reattach, exit status) and `cpuos shell` driven through
tmux (send-keys / capture-pane) like a person at a terminal."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuos import NotFound, Sandbox
from support.daemon import Daemon, wait_until

pytestmark = pytest.mark.e2e

CPUOS = str(Path(sys.executable).parent / "cpuos")


class Screen:
    """What a terminal has written, waited on by content."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.lock = threading.Lock()

    def __call__(self, data: bytes) -> None:
        with self.lock:
            self.buf += data

    def mark(self) -> int:
        with self.lock:
            return len(self.buf)

    def since(self, mark: int) -> bytes:
        with self.lock:
            return bytes(self.buf[mark:])

    def wait(self, pattern: bytes, mark: int = 0, what: str = "") -> bytes:
        wait_until(lambda: re.search(pattern, self.since(mark)) is not None,
                   what or repr(pattern), timeout=60)
        return self.since(mark)


def test_pty_from_the_sdk(sbx: Sandbox) -> None:
    scr = Screen()
    t = sbx.pty.create(cols=120, rows=40, on_data=scr)
    m = scr.mark()
    t.send_input("stty size; tty\n")
    out = scr.wait(rb"/dev/pts/\d+", m)
    assert b"40 120" in out, out

    m = scr.mark()
    t.resize(100, 30)
    t.send_input("stty size\n")
    scr.wait(rb"30 100", m, "the new size")

    # ^C interrupts the foreground job, not the shell
    m = scr.mark()
    t.send_input("sleep 300; echo not-interrupted\n")
    wait_until(lambda: "sleep 300" in sbx.exec("ps -eo args").stdout, "sleep running")
    t.send_input(b"\x03")
    t.send_input("echo status=$?\n")
    out = scr.wait(rb"status=130", m, "^C's status")
    assert b"not-interrupted" not in out.replace(b"echo not-interrupted", b"")

    # full-screen programs: they draw (less on the alternate screen, top its table), and
    # q quits back to the shell
    for prog, drawn in (("less /etc/os-release", rb"\x1b\[\?1049h"),
                        ("top -d 1", rb"load average")):
        m = scr.mark()
        t.send_input(prog + "\n")
        scr.wait(drawn, m, f"{prog} opened")
        name = prog.split()[0]

        def quit_it(name: str = name) -> bool:
            # (a key that arrives before the program took the terminal raw may be
            # flushed: press q until it is gone)
            t.send_input("q")
            return sbx.exec(["pgrep", "-x", name]).exit_code != 0

        wait_until(quit_it, f"{prog} quits on q")
        m2 = scr.mark()
        t.send_input("echo back-from-$((6*7))\n")
        scr.wait(rb"back-from-42", m2, f"{prog} quit")

    # detach: the shell goes on; attach again (another client) and finish it
    t.send_input("export KEPT=yes\n")
    t.disconnect()
    assert any(c.pid == t.pid and c.running for c in sbx.commands.list())
    scr2 = Screen()
    t2 = sbx.pty.connect(t.pid, on_data=scr2, offset=-1)
    t2.send_input("echo kept=$KEPT\n")
    scr2.wait(rb"kept=yes", 0, "the same shell")
    t2.send_input("exit 7\n")
    res = t2.wait()
    assert res.exit_code == 7, res
    with pytest.raises(NotFound):
        sbx.pty.connect(999999)


@pytest.fixture
def tmux() -> Iterator[list[str]]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup.sh installs it)")
    sock = f"cpuos-test-{os.getpid()}-{threading.get_ident()}"
    base = ["tmux", "-L", sock, "-f", "/dev/null"]
    yield base
    subprocess.run([*base, "kill-server"], capture_output=True)


def _pane(tmux: list[str], target: str) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", target], check=True,
                          capture_output=True, text=True).stdout


def _size(tmux: list[str], target: str) -> str:
    """The pane's size as stty prints it (rows cols; tmux's status line takes a row)."""
    return subprocess.run([*tmux, "display", "-p", "-t", target,
                           "#{pane_height} #{pane_width}"], check=True, capture_output=True,
                          text=True).stdout.strip()


def _keys(tmux: list[str], target: str, *keys: str) -> None:
    subprocess.run([*tmux, "send-keys", "-t", target, *keys], check=True)


def _wait_pane(tmux: list[str], target: str, pattern: str, what: str) -> str:
    try:
        wait_until(lambda: re.search(pattern, _pane(tmux, target)) is not None, what,
                   timeout=60)
    except TimeoutError:
        raise AssertionError(f"{what}: {pattern!r} not on the screen:\n"
                             f"{_pane(tmux, target)}") from None
    return _pane(tmux, target)


def test_cpuos_shell_through_tmux(daemon: Daemon, sbx: Sandbox, tmux: list[str]) -> None:
    env = f"CPUOS_API_URL={daemon.url} CPUOS_API_KEY={daemon.key}"
    run = f"env {env} {CPUOS} shell {sbx.id}"
    subprocess.run([*tmux, "new-session", "-d", "-s", "a", "-x", "120", "-y", "40",
                    f"{run}; echo EXIT=$?; sleep 600"], check=True)
    _wait_pane(tmux, "a", r"user@\S+:/work\$", "the prompt")
    _keys(tmux, "a", "stty size", "Enter")
    _wait_pane(tmux, "a", rf"(?m)^{_size(tmux, 'a')}$", "the terminal's size inside")
    subprocess.run([*tmux, "resize-window", "-t", "a", "-x", "100", "-y", "30"], check=True)
    assert _size(tmux, "a").endswith(" 100")
    _keys(tmux, "a", "clear; stty size", "Enter")
    _wait_pane(tmux, "a", rf"(?m)^{_size(tmux, 'a')}$", "the new size after SIGWINCH")
    _keys(tmux, "a", "echo $((40+2)) > /work/from-shell", "Enter")
    wait_until(lambda: sbx.files.exists("/work/from-shell"), "the command ran")
    assert sbx.files.read_text("/work/from-shell") == "42\n"
    _keys(tmux, "a", "exit 3", "Enter")
    _wait_pane(tmux, "a", r"EXIT=3", "cpuos shell exits with the shell's status")

    # detach with Ctrl-], attach again by pid from another terminal
    subprocess.run([*tmux, "new-session", "-d", "-s", "b", "-x", "120", "-y", "40",
                    f"{run}; echo EXIT=$?; sleep 600"], check=True)
    _wait_pane(tmux, "b", r"user@\S+:/work\$", "the prompt")
    _keys(tmux, "b", "export MARK=still-here", "Enter")
    _keys(tmux, "b", "C-]")
    pane = _wait_pane(tmux, "b", r"EXIT=0", "detached")
    pid = re.search(r"--attach (\d+)", pane.replace("\n", ""))
    assert pid is not None, pane
    subprocess.run([*tmux, "new-session", "-d", "-s", "c", "-x", "120", "-y", "40",
                    f"{run} --attach {pid.group(1)}; echo EXIT=$?; sleep 600"], check=True)
    _wait_pane(tmux, "c", r"export MARK=still-here", "its recent output, replayed")
    _keys(tmux, "c", "echo mark=$MARK", "Enter")
    _wait_pane(tmux, "c", r"mark=still-here", "the same shell")
    _keys(tmux, "c", "exit 5", "Enter")
    _wait_pane(tmux, "c", r"EXIT=5", "the status after reattaching")
