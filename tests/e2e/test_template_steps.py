"""The template builder's step runner on a tiny root (busybox-static as /bin/sh): steps run
one at a time by chroot with /proc, /dev and /sys mounted, a failing step is named with its
exit code and output, copies land inside the root, and the mounts are always gone after.
Needs root (chroot, mount); no mmdebstrap."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cpuosd.templates.builder import (
    Step,
    TemplateError,
    chroot_mounts,
    mounts_under,
    run_steps,
    shell_steps,
)

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, mount)")]

BUSYBOX = Path("/usr/bin/busybox")
APPLETS = ("true", "false", "echo", "cat", "ls", "mkdir", "test", "pwd")


def _static_busybox() -> Path:
    if not BUSYBOX.exists():
        pytest.skip("needs busybox-static (apt-get install busybox-static)")
    r = subprocess.run(["ldd", str(BUSYBOX)], capture_output=True, text=True)
    if "not a dynamic executable" not in r.stdout + r.stderr:
        pytest.skip(f"{BUSYBOX} is not static (apt-get install busybox-static)")
    return BUSYBOX


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "bin").mkdir(parents=True)
    shutil.copy2(_static_busybox(), r / "bin" / "sh")
    for name in APPLETS:
        (r / "bin" / name).symlink_to("sh")
    return r


def test_failing_step_is_named_and_mounts_are_gone(root: Path) -> None:
    lines: list[str] = []
    with pytest.raises(TemplateError) as e:
        run_steps(root, shell_steps(["echo hi", "echo before; exit 3", "echo never"]),
                  on_line=lines.append)
    msg = str(e.value)
    assert msg.splitlines()[0] == "run step 2 failed with exit code 3: echo before; exit 3"
    assert msg.splitlines()[1:] == ["before"]  # the step's last output lines
    assert "hi" in lines and "never" not in lines
    assert mounts_under(root) == []
    with open("/proc/mounts") as f:
        assert str(root.resolve()) not in f.read()


def test_steps_see_mounts_env_cwd_and_copies(root: Path, tmp_path: Path) -> None:
    src = tmp_path / "ctx"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.txt").write_text("module\n")
    (src / "one.txt").write_text("one\n")
    (root / "lib").symlink_to("/opt")  # absolute: means the root's /opt, not the host's
    (root / "work").mkdir()  # the base steps make it in a real build
    lines: list[str] = []
    run_steps(root, [
        Step("copy pkg", copy_from=src / "pkg", copy_to="/lib/pkg"),
        Step("copy one", copy_from=src / "one.txt", copy_to="/srv/"),
        *shell_steps(["test -r /proc/self/status && test -c /dev/null && test -d /sys/kernel",
                      'test -z "${SSL_CERT_FILE:-}" || test -r "$SSL_CERT_FILE"',  # host's CAs
                      "echo $GREETING",
                      "pwd; cat /opt/pkg/mod.txt /srv/one.txt"], cwd="/work"),
    ], env={"GREETING": "hello"}, on_line=lines.append)
    assert "hello" in lines and lines[-3:] == ["/work", "module", "one"]
    assert (root / "opt/pkg/mod.txt").is_file() and not Path("/opt/pkg/mod.txt").exists()
    assert mounts_under(root) == []
    assert sorted(os.listdir(root)) == ["bin", "dev", "lib", "opt", "proc", "srv", "sys", "work"]


def test_refuses_to_mount_on_a_symlink(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "sys").symlink_to(elsewhere)
    with pytest.raises(TemplateError, match="not a directory"), chroot_mounts(root):
        pass
    assert mounts_under(root) == [] and mounts_under(elsewhere) == []
