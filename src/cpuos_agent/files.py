"""File operations and the error codes OS errors map to.

Every path here is the sandbox's: code inside may have put a FIFO, a device, a socket or a
symlink anywhere, and may swap one for another at any moment. So nothing here can block
the agent on one: every open is non-blocking and checked afterwards (reads: regular files
only; a FIFO or device could block or never end), temporary files are created with
O_EXCL | O_NOFOLLOW under unpredictable names (O_TMPFILE would be neater; gVisor refuses
it), directories are walked by fd with O_NOFOLLOW and an fstat (``tarx.open_dir``: gVisor
follows a final symlink when O_DIRECTORY comes with O_NOFOLLOW). The agent acts with the
sandbox user's uid here (``privs.py``): following a symlink gives nothing the user lacks.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from typing import Any

from . import protocol as P

MAX_LIST = 10000


def _errcode(e: OSError) -> str:
    return {
        errno.ENOENT: P.E_NOT_FOUND,
        errno.EACCES: P.E_PERMISSION,
        errno.EPERM: P.E_PERMISSION,
        errno.EROFS: P.E_PERMISSION,
        errno.EEXIST: P.E_EXISTS,
        errno.EISDIR: P.E_IS_DIR,
        errno.ENOTDIR: P.E_NOT_DIR,
        errno.ENOSPC: P.E_NO_SPACE,
        errno.EDQUOT: P.E_NO_SPACE,
        errno.ENAMETOOLONG: P.E_INVALID,
        errno.ELOOP: P.E_INVALID,
        errno.EINVAL: P.E_INVALID,
        errno.ENXIO: P.E_INVALID,
        errno.ENOTEMPTY: P.E_EXISTS,
    }.get(e.errno or 0, P.E_INTERNAL)


NONBLOCK_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
TMP_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
             | os.O_NOCTTY | os.O_CLOEXEC)


class NotRegular(OSError):
    pass


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A blocking read fd of the regular file at path (symlinks followed) and its stat.
    The open itself never waits (O_NONBLOCK: a FIFO without a writer does not hold us);
    a directory is EISDIR, anything else but a regular file EINVAL."""
    fd = os.open(path, NONBLOCK_READ)
    try:
        st = os.fstat(fd)
        if stat_mod.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not stat_mod.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, "not a regular file (a FIFO, socket or device)",
                             path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small(path: str, limit: int) -> bytes:
    """At most limit bytes of a regular file (for the agent's own small files)."""
    fd, _ = open_regular(path)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def create_beside(path: str, mode: int = 0o644) -> tuple[int, str]:
    """A new, empty file in path's directory under a name nobody can predict, opened for
    writing: (fd, its path). O_EXCL | O_NOFOLLOW: whatever already sits at a name (a FIFO,
    a symlink) is never opened, another name is drawn."""
    parent = os.path.dirname(path) or "/"
    stem = os.path.basename(path)[:200]
    for _ in range(8):
        tmp = os.path.join(parent, f".{stem}.cpuos-{os.urandom(8).hex()}.tmp")
        try:
            fd = os.open(tmp, TMP_FLAGS, mode)
        except FileExistsError:
            continue
        os.set_blocking(fd, True)
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "could not create a temporary file", parent)


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def _kind(mode: int) -> str:
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "other"


def _stat(path: str) -> dict[str, Any]:
    st = os.lstat(path)
    d: dict[str, Any] = {"path": path, "name": os.path.basename(path) or "/",
                         "type": _kind(st.st_mode), "size": st.st_size,
                         "mode": stat_mod.S_IMODE(st.st_mode), "mtime": st.st_mtime}
    if d["type"] == "symlink":
        d["target"] = os.readlink(path)
    return d


def _list(path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with os.scandir(path) as it:
        for e in it:
            if len(out) >= MAX_LIST:
                break
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out.append({"name": e.name, "path": os.path.join(path, e.name),
                        "type": _kind(st.st_mode), "size": st.st_size,
                        "mode": stat_mod.S_IMODE(st.st_mode), "mtime": st.st_mtime})
    out.sort(key=lambda d: d["name"])
    return out


def _remove(path: str, recursive: bool) -> None:
    st = os.lstat(path)
    if not stat_mod.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    if recursive:
        from .tarx import open_dir  # (tarx loads tarfile: not resident in every agent)
        fd = open_dir(path)
        try:
            _empty_dir(fd)
        finally:
            os.close(fd)
    os.rmdir(path)


def _empty_dir(dfd: int) -> None:
    """Remove everything in the directory open at dfd, by fd (a directory swapped for a
    symlink or a FIFO meanwhile fails ``open_dir``: never followed, never
    waited on)."""
    from .tarx import open_dir
    with os.scandir(dfd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        try:
            if is_dir:
                fd = open_dir(name, dfd)
                try:
                    _empty_dir(fd)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
