"""Directories as tar streams: extract an uploaded archive into a directory (every member
checked before anything is written: no entry may land outside the target, links stay
inside, only files, directories and links), and pack a directory into a stream.

Code inside the sandbox may swap a directory for a symlink at any moment; the agent acts
with the sandbox user's uid (``privs.py``), so what such a race reaches is what the user
could write anyway. Extraction still never follows a symlink it meets on the way
(O_NOFOLLOW, lstat of every parent).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import errno
import os
import posixpath
import stat as stat_mod
import tarfile
from collections.abc import Callable
from typing import Any

MAX_MEMBERS = 100_000


class Refused(ValueError):
    """The archive is not acceptable (nothing was written)."""


def _clean(name: str) -> str:
    if not name or "\x00" in name:
        raise Refused(f"an entry has an empty or NUL name: {name!r}")
    if name.startswith("/"):
        raise Refused(f"entry {name!r} is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"entry {name!r} climbs out with '..'")
    return "/".join(parts)


def check_members(members: list[tarfile.TarInfo]) -> list[tuple[tarfile.TarInfo, str]]:
    """Every member with its cleaned relative path, or Refused naming the first bad one."""
    if len(members) > MAX_MEMBERS:
        raise Refused(f"more than {MAX_MEMBERS} entries")
    out: list[tuple[tarfile.TarInfo, str]] = []
    links: set[str] = set()
    seen: set[str] = set()
    for m in members:
        rel = _clean(m.name)
        if not rel:
            continue  # "." itself
        for i in range(1, len(rel.split("/"))):
            if "/".join(rel.split("/")[:i]) in links:
                raise Refused(f"entry {m.name!r} goes through a link in the archive")
        if m.isdir() or m.isreg():
            pass
        elif m.issym():
            target = m.linkname
            if not target or target.startswith("/"):
                raise Refused(f"symlink {m.name!r} points outside ({target!r})")
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
            if resolved == ".." or resolved.startswith("../"):
                raise Refused(f"symlink {m.name!r} points outside ({target!r})")
            links.add(rel)
        elif m.islnk():
            if _clean(m.linkname) not in seen:
                raise Refused(f"hard link {m.name!r} to {m.linkname!r}: not an earlier "
                              "file of the archive")
        else:
            raise Refused(f"entry {m.name!r} is not a file, directory or link")
        seen.add(rel)
        out.append((m, rel))
    return out


def _no_links_below(dest: str, rel: str) -> None:
    """Every existing parent of dest/rel under dest is a real directory (not a symlink)."""
    cur = dest
    for part in rel.split("/")[:-1]:
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if not stat_mod.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "a parent is not a directory (or is a link)", cur)


def extract(archive: str, dest: str) -> dict[str, Any]:
    """Extract the tar at archive into dest (created); {files, dirs, links, bytes}."""
    with tarfile.open(archive, "r:*") as tf:
        members = check_members(tf.getmembers())
        os.makedirs(dest, exist_ok=True)
        n = {"files": 0, "dirs": 0, "links": 0, "bytes": 0}
        dirs: list[tuple[str, int]] = []
        for m, rel in members:
            path = os.path.join(dest, rel)
            _no_links_below(dest, rel)
            mode = m.mode & 0o777
            if m.isdir():
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    if not stat_mod.S_ISDIR(os.lstat(path).st_mode):
                        raise
                dirs.append((path, mode))
                n["dirs"] += 1
                continue
            parent = os.path.dirname(path)
            os.makedirs(parent, exist_ok=True)
            try:
                if stat_mod.S_ISDIR(os.lstat(path).st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory", path)
                os.unlink(path)
            except FileNotFoundError:
                pass
            if m.issym():
                os.symlink(m.linkname, path)
                n["links"] += 1
            elif m.islnk():
                os.link(os.path.join(dest, _clean(m.linkname)), path, follow_symlinks=False)
                n["links"] += 1
            else:
                src = tf.extractfile(m)
                assert src is not None
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
                try:
                    while True:
                        b = src.read(1 << 20)
                        if not b:
                            break
                        view = memoryview(b)
                        while view:
                            view = view[os.write(fd, view):]
                        n["bytes"] += len(b)
                    os.fchmod(fd, mode)
                    os.utime(fd, (m.mtime, m.mtime))
                finally:
                    os.close(fd)
                n["files"] += 1
        for path, mode in reversed(dirs):  # last: a read-only directory was filled first
            os.chmod(path, mode, follow_symlinks=False)
        return n


class _Sink:
    """A write-only file object handing each write to ``send``."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self.send = send
        self.n = 0

    def write(self, b: bytes) -> int:
        if b:
            self.send(bytes(b))
            self.n += len(b)
        return len(b)

    def flush(self) -> None:
        pass


def pack(path: str, send: Callable[[bytes], None]) -> int:
    """A tar of the directory at path (links stored as links, never followed), streamed to
    send in pieces; the byte count."""
    st = os.stat(path)
    if not stat_mod.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
    sink = _Sink(send)
    with tarfile.open(fileobj=sink, mode="w|", bufsize=256 * 1024,  # type: ignore[call-overload]
                      format=tarfile.PAX_FORMAT) as tf:
        for root, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(root, name)
                rel = os.path.relpath(full, path)
                try:
                    info = tf.gettarinfo(full, arcname=rel)
                except OSError:
                    continue  # gone meanwhile
                if info.isreg():
                    try:
                        with open(full, "rb", opener=lambda p, f: os.open(
                                p, f | os.O_NOFOLLOW | os.O_NONBLOCK)) as f:
                            tf.addfile(info, f)
                    except OSError:
                        continue
                elif info.isdir() or info.issym() or info.islnk():
                    tf.addfile(info)
    return sink.n
