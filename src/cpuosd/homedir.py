"""``$CPUOS_HOME`` is the daemon's alone (issue 25, finding 9: the SQLite side files
``cpuos.db-wal``/``-shm`` were 0644, and another local user read preview tokens,
environment values and command lines from them).

* ``private_umask()``: the daemon, and the ``cpuosd`` subcommands that open its databases,
  run under umask 077, set at start before anything is opened: every file they create is
  their user's only (SQLite's side files, keys, logs, snapshots, sockets) unless its mode
  is set on purpose.
* ``secure(home)``: at every start the directory is made 0700 and the files directly in it
  (databases and their side files, keys, the audit head, a log kept there) lose any
  group/other bit an older daemon, or one run under another umask, left on them.
* Children keep the usual umask (``CHILD_UMASK``, ``cpuosd.procs.spawn``): template builds
  write root filesystems whose modes the sandboxes' users rely on, and the microVM jailer
  builds a jail that QEMU, an unprivileged user, must be able to read.

What must stay reachable from a sandbox gets its mode set explicitly, and is reachable
only by the daemon's own children (runsc's gofer, the jailer: root), never through
``$CPUOS_HOME`` by another host user: the agent package copy (``agent/``, 0755/0644: the
agent reads it as the sandbox's user), a sandbox's socket directory (0755), its agent
socket (0666) and machine-id (0444)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
CHILD_UMASK = 0o022


def private_umask() -> None:
    os.umask(PRIVATE_UMASK)


def secure(home: Path) -> list[str]:
    """``home`` made (0700) or set to 0700, and the regular files directly in it stripped
    of group/other bits; the names changed."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    changed = []
    if stat.S_IMODE(home.stat().st_mode) != 0o700:
        os.chmod(home, 0o700)
        changed.append(str(home))
    for entry in os.scandir(home):
        with contextlib.suppress(FileNotFoundError):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                os.chmod(entry.path, stat.S_IMODE(st.st_mode) & 0o700)
                changed.append(entry.name)
    return changed


def create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless it exists (before SQLite opens it: its
    -wal and -shm files then get the same mode, whatever the umask)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))


def private_db_files(db: Path) -> None:
    """The database and its side files (those that exist) at 0600."""
    for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"),
              db.with_name(db.name + "-journal")):
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != 0o600:
                os.chmod(p, 0o600)
