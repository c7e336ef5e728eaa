"""Files: the ``write`` (``data``..., ``eof``), ``read``, ``stat``, ``list``, ``remove``,
``mkdir``, ``tar`` and ``untar`` requests, and the file operations under them.

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
import json
import os
import stat as stat_mod
import threading
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .protocol import Kind
from .service import errcode, in_thread, send_oserror
from .transport import Closed

if TYPE_CHECKING:
    from .agent import Agent, Handler
    from .conn import Conn

MAX_LIST = 10000


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


# ---- the requests ---------------------------------------------------------------------
def write(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    """A new file beside path, filled by ``data`` frames and put in place at ``eof``
    (answered ``ok`` with its stat), or dropped (``eof`` with ``abort``; a disconnect)."""
    path: str = h["path"]
    parent = os.path.dirname(path) or "/"
    os.makedirs(parent, exist_ok=True)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    fd, tmp = create_beside(path)
    agent.writes[sid] = (fd, tmp, path)


def data(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    w = agent.writes.get(sid)
    if w is None:
        return
    try:
        view = memoryview(payload)
        while view:  # a regular file of ours (O_EXCL): never blocks
            view = view[os.write(w[0], view):]
    except OSError as e:
        agent.writes.pop(sid)
        os.close(w[0])
        _unlink_quiet(w[1])
        conn.send({"t": Kind.ERR, "id": sid, "code": errcode(e),
                   "message": f"writing {w[2]}: {e.strerror}"})


def eof(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    w = agent.writes.pop(sid, None)
    if w is None:
        return
    fd, tmp, path = w
    try:
        try:
            if h.get("abort"):
                _unlink_quiet(tmp)
                return
            try:  # a replaced file keeps its mode
                os.fchmod(fd, stat_mod.S_IMODE(os.stat(path).st_mode))
            except OSError:
                pass
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        _unlink_quiet(tmp)
        conn.send({"t": Kind.ERR, "id": sid, "code": errcode(e), "message": f"{e.strerror}"})
        return
    conn.send({"t": Kind.OK, "id": sid, "stat": _stat(path)})


def read(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    threading.Thread(target=_read, args=(conn, sid, h["path"]), daemon=True).start()


def stat(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    conn.send({"t": Kind.OK, "id": sid, "stat": _stat(h["path"])})


def listing(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    path = h["path"]
    in_thread(conn, sid, lambda: _listing(path))


def remove(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    path, recursive = h["path"], bool(h.get("recursive", True))
    in_thread(conn, sid, lambda: _remove(path, recursive))


def mkdir(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    os.makedirs(h["path"], mode=0o755, exist_ok=True)
    conn.send({"t": Kind.OK, "id": sid, "stat": _stat(h["path"])})


def tar(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    threading.Thread(target=_tar, args=(conn, sid, h["path"]), daemon=True).start()


def untar(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    archive, dest = h["archive"], h["path"]
    in_thread(conn, sid, lambda: _untar(archive, dest))


HANDLERS: dict[Kind, Handler] = {
    Kind.WRITE: write,
    Kind.DATA: data,
    Kind.EOF: eof,
    Kind.READ: read,
    Kind.STAT: stat,
    Kind.LIST: listing,
    Kind.REMOVE: remove,
    Kind.MKDIR: mkdir,
    Kind.TAR: tar,
    Kind.UNTAR: untar,
}


def _tar(conn: Conn, sid: int, path: str) -> None:
    """Stream a tar of the directory at path: ``ok`` (length unknown), ``data``...,
    ``eof`` or ``err`` (as a file read; the host ends one early with ``kill``)."""
    def send(b: bytes) -> None:
        for i in range(0, len(b), P.CHUNK):
            conn.send_data(sid, {"t": Kind.DATA, "id": sid}, b[i:i + P.CHUNK])
    from . import tarx  # (only when asked)
    try:
        try:
            if not stat_mod.S_ISDIR(os.stat(path).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        except OSError as e:
            conn.send({"t": Kind.ERR, "id": sid, "code": errcode(e),
                       "message": f"{path}: {e.strerror}"})
            return
        conn.open_stream(sid)
        try:
            conn.send({"t": Kind.OK, "id": sid, "size": 0, "exact": False})
            tarx.pack(path, send)
            conn.send({"t": Kind.EOF, "id": sid})
        finally:
            conn.close_stream(sid)
    except Closed:
        pass
    except OSError as e:
        send_oserror(conn, sid, e, f"{path}: ")


def _read(conn: Conn, sid: int, path: str) -> None:
    """Stream a regular file. ``exact`` in the answer: the file has real blocks, so its
    size is its length, and exactly ``size`` bytes follow (a file that grows is cut
    there; one that shrank is an error). Otherwise (procfs, sysfs: size 0 or made up)
    the length is known only at ``eof``."""
    try:
        try:
            fd, st = open_regular(path)
        except OSError as e:
            conn.send({"t": Kind.ERR, "id": sid, "code": errcode(e),
                       "message": f"{path}: {e.strerror}"})
            return
        try:
            exact = st.st_size > 0 and st.st_blocks > 0
            left = st.st_size if exact else -1
            conn.open_stream(sid)
            conn.send({"t": Kind.OK, "id": sid, "size": st.st_size, "exact": exact})
            try:
                while left != 0:
                    data = os.read(fd, P.CHUNK if left < 0 else min(P.CHUNK, left))
                    if not data:
                        if left > 0:
                            raise OSError(errno.EIO, f"{path} shrank while being read")
                        break
                    if left > 0:
                        left -= len(data)
                    conn.send_data(sid, {"t": Kind.DATA, "id": sid}, data)
                conn.send({"t": Kind.EOF, "id": sid})
            finally:
                conn.close_stream(sid)
        finally:
            os.close(fd)
    except Closed:
        pass
    except OSError as e:
        send_oserror(conn, sid, e, f"{path}: ")


def _untar(archive: str, dest: str) -> dict[str, Any]:
    """Extract the uploaded archive into dest (every entry checked first: a refused
    archive writes nothing); the archive is removed either way."""
    import tarfile  # (tarfile and tarx: only when asked; not resident in every agent)

    from . import tarx
    try:
        return {"extracted": tarx.extract(archive, dest)}
    except tarx.Refused as e:
        raise OSError(errno.EINVAL, f"archive refused, nothing written: {e}") from None
    except tarfile.TarError as e:
        raise OSError(errno.EINVAL, f"not a readable tar archive: {e}") from None
    finally:
        _unlink_quiet(archive)


def _listing(path: str) -> tuple[dict[str, Any], bytes]:
    """A directory's entries, as JSON in the payload (a header holds at most 64 KiB: a few
    hundred entries); as many as fit in one frame."""
    entries = _list(path)
    while True:
        data = json.dumps(entries, separators=(",", ":")).encode()
        if len(data) <= P.MAX_PAYLOAD or not entries:
            return {"n": len(entries)}, data
        entries = entries[: len(entries) // 2]
