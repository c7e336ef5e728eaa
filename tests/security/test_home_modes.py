"""$CPUOS_HOME is the daemon's alone (issue 25, finding 9): SQLite's side files were 0644
and another local user read a preview token, environment values and command lines from
``cpuos.db-wal``. After a real daemon's start and some activity (create, exec, files,
pause, resume), nothing under $CPUOS_HOME is readable by group or others but what a
sandbox must reach (documented in cpuosd.homedir), another user (``nobody``) can read none
of it, and files an older daemon left readable are fixed at the next start."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuos import Sandbox
from support.daemon import Daemon, e2e_unavailable, new_daemon

pytestmark = pytest.mark.e2e

NOBODY = 65534


def allowed(rel: Path, st: os.stat_result) -> bool:
    """What a sandbox reaches (through runsc's gofer, as root; the host path is never
    reachable by another user: $CPUOS_HOME is 0700)."""
    parts = rel.parts
    mode = stat.S_IMODE(st.st_mode)
    if parts[0] == "agent" and len(parts) >= 2:  # the agent package, read inside as uid 1000
        return mode in (0o755, 0o644)
    if parts[0] == "sandboxes" and len(parts) >= 3 and parts[2] == "sock":  # /run/cpuos
        if len(parts) == 3:
            return mode == 0o755
        return (parts[3], mode) in {("agent.sock", 0o666), ("machine-id", 0o444),
                                    ("ca.pem", 0o444), ("ca-bundle.pem", 0o444)}
    return False


def exposed(home: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(home):
        for n in dirnames + filenames:
            p = Path(dirpath, n)
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o066:
                continue
            if not allowed(p.relative_to(home), st):
                out.append(f"{stat.S_IMODE(st.st_mode):o} {p.relative_to(home)}")
    return out


def readable_by_nobody(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        r = subprocess.run(["head", "-c", "1", str(p)], user=NOBODY, group=NOBODY,
                           extra_groups=[], capture_output=True, timeout=30)
        if r.returncode == 0:
            out.append(str(p))
    return out


@pytest.fixture
def home_daemon() -> Iterator[Daemon]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon(CPUOS_POOL_SIZE="1")
    d.extra_env["CPUOS_LOG_FILE"] = str(d.home / "daemon.log")
    d.start()
    yield d
    assert not d.teardown(False)


def test_nothing_under_home_is_readable_by_others(home_daemon: Daemon, tmp_path: Path) -> None:
    d = home_daemon
    kw = d.sdk_kwargs()
    sbx = Sandbox.create(template="python", timeout="10m", env={"TOKEN": "s3cr3t-env"}, **kw)
    try:
        assert sbx.exec("echo s3cr3t-cmd > /work/x && cat /work/x").stdout == "s3cr3t-cmd\n"
        sbx.files.write("/work/y", "data")
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "a").write_text("a")
        sbx.files.upload_dir(tmp_path / "up", "/work/up")
        assert sbx.files.download_dir("/work/up", tmp_path / "back") > 0
        sbx.pause()  # a snapshot of its memory under $CPUOS_HOME/snapshots
        paused = exposed(d.home)
        sbx2 = Sandbox.resume(sbx.id, **kw)
        assert sbx2.exec("cat /work/x").stdout == "s3cr3t-cmd\n"
        other = Sandbox.create(template="python", timeout="10m", **kw)
        other.pause()  # and one that stays paused while we look
        assert stat.S_IMODE(d.home.stat().st_mode) == 0o700
        assert paused == [] and exposed(d.home) == []
        files = [Path(dp, n) for dp, _, fs in os.walk(d.home) for n in fs]
        names = {p.name for p in files}
        assert {"cpuos.db-wal", "cpuos.db-shm", "audit.db-wal", "admin.key"} <= names, names
        assert readable_by_nobody([p for p in files if not p.is_socket()]) == []
        sbx2.kill()
        other.kill()
    finally:
        sbx.close()


def test_modes_left_by_an_older_daemon_are_fixed_at_start(home_daemon: Daemon) -> None:
    d = home_daemon
    with Sandbox.create(template="python", timeout="5m", **d.sdk_kwargs()) as sbx:
        sbx.exec("true")
        sbx.kill()
    d.stop()
    os.chmod(d.home, 0o755)  # as main before this fix left them (0711), or worse
    loose = [p for p in d.home.iterdir() if p.is_file()]
    for p in loose:
        os.chmod(p, 0o644)
    d.start()
    assert stat.S_IMODE(d.home.stat().st_mode) == 0o700
    left = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in d.home.iterdir()
            if p.is_file() and stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert left == {}, left
    # the host-side audit check (a subcommand that opens the databases) keeps them private
    r = subprocess.run([sys.executable, "-m", "cpuosd", "audit", "verify", "--home",
                        str(d.home)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r
    assert exposed(d.home) == []
