"""Template RAM: a memfd shared by a template's clones, sealed against writes.

QEMU 7.2 opens ``memory-backend-file``'s ``mem-path`` read-write even with ``share=off``
(``readonly=on`` maps it read-only, so the guest could not run; the ``rom=`` property that
separates the two came in 8.2). A template's RAM file opened read-write by every clone is
a file one compromised clone could write into, poisoning the next clone. So the RAM is a
memfd, not a file: the template boots with it mapped ``share=on``; once the template's
QEMU has exited the daemon seals it (``F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK |
F_SEAL_SEAL``). A clone still opens it read-write and maps it ``MAP_PRIVATE`` (copy on
write: its pages are its own), but ``write(2)``, ``fallocate(2)``, ``ftruncate(2)`` and a
shared writable mapping all fail with ``EPERM`` for everyone, root included.

Before it is sealed, the memfd's holes are filled (``posix_fallocate``: zeroed pages,
charged to the daemon): tmpfs allocates a page for any fault in a hole, a read through a
private mapping included, and charges it to the faulting clone's cgroup — a clone touching
all its RAM would be charged twice (that page plus its private copy) and hit its memory
limit at half its RAM. Filled, the template costs one guest RAM of host memory, shared by
all its clones, and a clone's cgroup holds only its own copies.

The memfd reaches a jail as an inherited fd (the jailer's ``--keep-fd``; a bind mount of
``/proc/<pid>/fd/<n>`` is refused, EINVAL: the memfd's mount is not in our namespace) that
QEMU opens as ``mem-path=/proc/self/fd/<n>`` (the jail then has a ``/proc`` of its own pid
namespace); the memfd's inode is mode 0777, so the jail's unprivileged QEMU may open it.
Held only by the daemon, it is also saved (sparse) beside the template's device state,
and loaded (and sealed) again by a restarted daemon.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .guest_artifacts import copy_sparse_fd

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def new(name: str, size: int) -> int:
    """A sealable memfd of ``size`` bytes (all holes). Not inherited by children."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal(fd: int) -> None:
    """No more writes, size changes or seal changes (fails with EBUSY while a shared
    writable mapping exists: the template's QEMU must have exited)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def fill(fd: int) -> None:
    """Allocate every page of the memfd (holes become zero pages; data stays)."""
    os.posix_fallocate(fd, 0, os.fstat(fd).st_size)


def sealed(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS


def jail_path(fd: int) -> str:
    """The ``mem-path`` of a memfd a jailed QEMU inherited as fd ``fd``."""
    return f"/proc/self/fd/{fd}"


def save(fd: int, path: Path) -> int:
    """Write the memfd's pages (not its holes) to a new sparse file; returns the bytes."""
    size = os.fstat(fd).st_size
    tmp = path.with_name(path.name + ".tmp")
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(out, size)
        n = copy_sparse_fd(fd, out, size)
        os.fsync(out)
    finally:
        os.close(out)
    os.replace(tmp, path)
    return n


def load(path: Path, name: str) -> int:
    """A filled, sealed memfd holding the (sparse) file at ``path``."""
    src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(src).st_size
        fd = new(name, size)
        try:
            copy_sparse_fd(src, fd, size)
            fill(fd)
            seal(fd)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(src)
    return fd
