"""File operations and the error codes OS errors map to.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import errno
import os
import shutil
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
        errno.ENOTEMPTY: P.E_EXISTS,
    }.get(e.errno or 0, P.E_INTERNAL)


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
    if stat_mod.S_ISDIR(st.st_mode):
        if recursive:
            shutil.rmtree(path)
        else:
            os.rmdir(path)
    else:
        os.unlink(path)
