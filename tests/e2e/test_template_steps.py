"""The template builder's step runner on a tiny root (busybox-static as /bin/sh): each shell
step runs as root in a runsc sandbox over the tree (real runsc), one at a time; a failing
step is named with its exit code and output, copies land inside the root, what a step
writes lands in the tree (its /tmp too), and nothing is left behind (no runsc container,
no state directory, no mount). The attacks on the host from a step are in
tests/security/test_build_containment.py. Needs root (runsc); no mmdebstrap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cpuosd.templates.builder import Step, TemplateError, run_steps, shell_steps
from support.daemon import build_steps_left, wait_until

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runsc)")]

@pytest.fixture
def root(busybox_tree: Path) -> Path:
    return busybox_tree


def test_failing_step_is_named_and_nothing_is_left(root: Path) -> None:
    lines: list[str] = []
    with pytest.raises(TemplateError) as e:
        run_steps(root, shell_steps(["echo hi", "echo before; exit 3", "echo never"]),
                  on_line=lines.append)
    msg = str(e.value)
    assert msg.splitlines()[0] == "run step 2 failed with exit code 3: echo before; exit 3"
    assert msg.splitlines()[1:] == ["before"]  # the step's last output lines
    assert "hi" in lines and "never" not in lines
    assert build_steps_left(root) == []


def test_steps_see_their_own_kernel_env_cwd_and_copies(root: Path, tmp_path: Path) -> None:
    src = tmp_path / "ctx"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.txt").write_text("module\n")
    (src / "one.txt").write_text("one\n")
    (root / "lib").symlink_to("/opt")  # absolute: means the root's /opt, not the host's
    lines: list[str] = []
    run_steps(root, [
        Step("copy pkg", copy_from=src / "pkg", copy_to="/lib/pkg"),
        Step("copy one", copy_from=src / "one.txt", copy_to="/srv/"),
        *shell_steps(["test -r /proc/self/status && test -c /dev/null && test -d /sys/kernel",
                      'test -z "${SSL_CERT_FILE:-}" || test -r "$SSL_CERT_FILE"',  # host's CAs
                      "echo $GREETING",
                      # gVisor's kernel, not the host's; root inside
                      "id -u; grep -ci gvisor /proc/version",
                      "mkdir -p /home/user && chown 1000:1000 /home/user && echo t > /tmp/kept",
                      "cat /tmp/kept",  # the tree's /tmp, kept from step to step
                      "pwd; cat /opt/pkg/mod.txt /srv/one.txt"], cwd="/work"),
    ], env={"GREETING": "hello"}, on_line=lines.append)
    assert "hello" in lines and lines[-3:] == ["/work", "module", "one"]
    i = lines.index("hello")
    assert lines[i + 2] == "0" and lines[i + 3] == "1", lines  # uid 0; /proc/version: gVisor
    assert "t" in lines
    assert (root / "opt/pkg/mod.txt").is_file() and not Path("/opt/pkg/mod.txt").exists()
    # what a step wrote is in the tree, owned by the ids it had inside
    st = (root / "home/user").stat()
    assert (st.st_uid, st.st_gid) == (1000, 1000)
    assert (root / "tmp/kept").read_text() == "t\n"
    assert not (root / ".cpuos-build-ca.crt").exists()  # the host's CAs: during steps only
    assert build_steps_left(root) == []


STOPPED_BUILD = """
import signal, sys
from pathlib import Path
from cpuosd.templates.builder import run_steps, shell_steps
def term(signum, frame):
    raise SystemExit(128 + signum)  # as cpuosd.templates.admin does
signal.signal(signal.SIGTERM, term)
run_steps(Path(sys.argv[1]), shell_steps(["echo started; sleep 600"]), on_line=print)
"""


def test_sigterm_mid_step_ends_its_sandbox(root: Path) -> None:
    """The daemon stops a build with SIGTERM (a client that left, an overrun): the step's
    runsc sandbox is gone with it, and so is the runner's state."""
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_BUILD, str(root)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.strip() == "started":
                break
        else:
            raise AssertionError(f"the step never started (exit {proc.wait()})")
        assert any(x.startswith("process ") for x in build_steps_left(root))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until(lambda: build_steps_left(root) == [], "the step's sandbox is gone", timeout=60)
