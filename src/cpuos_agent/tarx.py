"""Directories as tar streams, and the one safe way cpuos extracts a tar anywhere: the
agent (``upload_dir`` into a sandbox), the SDK (``download_dir`` onto the client's host)
and the daemon (template build contexts) all check and write archives here.

The rules (``check_members``; every member checked before anything is written):

* names are relative, without ``..``; only directories, regular files and links (no
  devices, FIFOs, sparse members);
* a symlink's target is relative and has no ``..`` at all: a target is never judged by
  where its text seems to lead (``a -> .``, ``x1 -> a/..``, ``x2 -> x1/..``... looks
  inside and climbs a level per link), so every link written resolves below the link's
  own directory, whatever links an earlier extraction left there;
* no entry, and no symlink target, goes through a symlink of the archive;
* a hard link names an earlier regular file of the archive;
* with ``links=False`` (build contexts) no link of either kind.

Writing (``extract_members``) resolves every path beneath the target directory one
component at a time from a directory fd, ``O_NOFOLLOW`` then ``fstat`` (not
``O_DIRECTORY``, which makes gVisor follow the link): a symlink already on
disk (planted by code in a sandbox, left by an earlier download, or made by the archive
itself) is never followed; files are created ``O_EXCL | O_NOFOLLOW`` after whatever was at
the name is removed; modes and times are set on fds (never through a path that could be a
link); nothing is chowned. ``openat2(RESOLVE_BENEATH)`` would do the walk in one call on
Linux >= 5.6 (gVisor has it too), but the SDK also runs where it does not exist (macOS):
one code path, the portable one.

``TarScanner`` checks a tar as its bytes arrive (headers only are kept): a client refuses
a stream whose declared sizes pass its limit at the first such header, before spooling the
rest.

Stdlib only: it runs inside every sandbox (Debian's Python, whose tarfile has no
extraction filters; none is used here)."""

from __future__ import annotations

import errno
import os
import posixpath
import stat as stat_mod
import tarfile
from collections.abc import Callable, Iterable
from typing import Any

MAX_MEMBERS = 100_000
MAX_EXTENSION = 1 << 20  # bytes of one pax / GNU long-name header's data
BLOCK = 512

_O = {k: getattr(os, k, 0) for k in ("O_NOFOLLOW", "O_CLOEXEC", "O_NONBLOCK")}
# no O_DIRECTORY: gVisor follows a final symlink when O_DIRECTORY and O_NOFOLLOW are both
# given (checked under runsc here: the open succeeds on the link's target); O_NOFOLLOW alone
# is ELOOP there as on Linux, and the fd's fstat says whether it is a directory
# (O_NONBLOCK: a FIFO at the name is opened without waiting, then refused)
NOFOLLOW_OPEN = os.O_RDONLY | _O["O_NOFOLLOW"] | _O["O_CLOEXEC"] | _O["O_NONBLOCK"]
FILE_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O["O_NOFOLLOW"] | _O["O_CLOEXEC"] \
    | _O["O_NONBLOCK"]


class Refused(ValueError):
    """The archive is not acceptable (nothing was written)."""


class TooBig(Refused):
    """The archive declares more bytes than the limit it was read under."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


def _clean(name: str) -> str:
    if not name or "\x00" in name:
        raise Refused(f"an entry has an empty or NUL name: {name!r}")
    if name.startswith("/"):
        raise Refused(f"entry {name!r} is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"entry {name!r} climbs out with '..'")
    return "/".join(parts)


def check_link_target(name: str, target: str) -> None:
    """A symlink's target: relative, no '..' (Refused otherwise)."""
    if not target or "\x00" in target:
        raise Refused(f"symlink {name!r} has an empty or NUL target")
    if target.startswith("/"):
        raise Refused(f"symlink {name!r} points outside: absolute target {target!r}")
    if ".." in target.split("/"):
        raise Refused(f"symlink {name!r} points outside: its target {target!r} has '..'")


def check_type(m: tarfile.TarInfo, links: bool = True) -> None:
    """The member's kind is one we write (Refused naming it otherwise)."""
    if m.issparse() or m.type == tarfile.GNUTYPE_SPARSE:
        raise Refused(f"entry {m.name!r} is a sparse file")
    if m.isdir() or m.isreg():
        return
    if m.issym() or m.islnk():
        if not links:
            raise Refused(f"entry {m.name!r} is a {'symbolic' if m.issym() else 'hard'} "
                          "link (not allowed here)")
        if m.issym():
            check_link_target(m.name, m.linkname)
        return
    raise Refused(f"entry {m.name!r} is not a file, directory or link")


def _prefixes(rel: str) -> Iterable[str]:
    """'a/b/c' -> 'a', 'a/b' (the directories a path goes through)."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


def check_members(members: Iterable[tarfile.TarInfo], *, links: bool = True,
                  max_members: int = MAX_MEMBERS, max_bytes: int | None = None,
                  ) -> list[tuple[tarfile.TarInfo, str]]:
    """Every member with its cleaned relative path, or Refused naming the first bad one.
    ``members`` is consumed one by one (at most ``max_members``; a TarFile itself is
    fine); ``max_bytes`` bounds the sum of the files' sizes (TooBig)."""
    out: list[tuple[tarfile.TarInfo, str]] = []
    files: set[str] = set()
    total = 0
    for m in members:
        if len(out) >= max_members:
            raise Refused(f"more than {max_members} entries")
        rel = _clean(m.name)
        if not rel:
            continue  # "." itself
        check_type(m, links)
        if m.isreg():
            total += m.size
            if max_bytes is not None and total > max_bytes:
                raise TooBig(f"the archive holds more than {max_bytes} bytes (at {m.name!r})",
                             max_bytes)
        if m.islnk():
            try:
                source = _clean(m.linkname)
            except Refused:
                source = ""
            if source not in files:
                raise Refused(f"hard link {m.name!r} to {m.linkname!r}: not an earlier file "
                              "of the archive")
        (files.add if m.isreg() else files.discard)(rel)
        out.append((m, rel))
    # through a link: against every symlink of the archive, before or after the entry
    symlinks = {rel for m, rel in out if m.issym()}
    if symlinks:
        for m, rel in out:
            for p in _prefixes(rel):
                if p in symlinks:
                    raise Refused(f"entry {m.name!r} goes through a link in the archive "
                                  f"({p!r})")
            if m.issym():
                target = posixpath.normpath(posixpath.join(posixpath.dirname(rel),
                                                           m.linkname))
                for p in _prefixes(target):
                    if p in symlinks:
                        raise Refused(f"symlink {m.name!r} points through the link {p!r} "
                                      "of the archive")
    return out


# ---- writing -------------------------------------------------------------------------------
def open_dir(name: str, dir_fd: int | None = None) -> int:
    """An fd of the directory ``name`` (in ``dir_fd``), never through a symlink: ELOOP for
    a link, ENOTDIR for anything else but a directory."""
    fd = os.open(name, NOFOLLOW_OPEN, dir_fd=dir_fd)
    try:
        if not stat_mod.S_ISDIR(os.fstat(fd).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(parent: int, name: str, create: bool, mode: int | None) -> int:
    """The directory ``name`` in ``parent``, never through a symlink (ENOTDIR/ELOOP); made
    if missing and ``create`` (``mode``: set explicitly; None: 0777 less the umask, as tar
    makes a parent the archive does not list)."""
    try:
        return open_dir(name, parent)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o777 if mode is None else 0o700, dir_fd=parent)
    except FileExistsError:
        return open_dir(name, parent)  # made meanwhile: opened O_NOFOLLOW as ever
    fd = open_dir(name, parent)
    if mode is not None:
        os.fchmod(fd, mode)
    return fd


def _walk(root: int, parts: list[str], create: bool = True, mode: int | None = None) -> int:
    """An fd of root/parts[0]/.../parts[-1], each step ``O_NOFOLLOW`` (a symlink on the way
    fails ELOOP or ENOTDIR); the caller closes it."""
    fd = os.dup(root)
    try:
        for part in parts:
            nxt = _open_dir(fd, part, create, mode)
            os.close(fd)
            fd = nxt
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(e.errno, f"{'/'.join(parts)}: a symlink or not a directory on the "
                          "way (never followed)") from None
        raise
    return fd


def _clear(parent: int, name: str, for_dir: bool) -> bool:
    """Make room for a new entry at name: a non-directory there is removed (a symlink
    itself, never what it points at). True if a real directory is there (kept)."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat_mod.S_ISDIR(st.st_mode):
        if for_dir:
            return True
        raise IsADirectoryError(errno.EISDIR, "is a directory", name)
    os.unlink(name, dir_fd=parent)
    return False


def extract_members(tf: tarfile.TarFile, members: list[tuple[tarfile.TarInfo, str]],
                    dest: str, *, chunk: int = 1 << 20, dir_mode: int | None = None,
                    ) -> dict[str, int]:
    """Write checked members (``check_members``) into the directory dest (created; dest
    itself is the caller's path, everything below it is resolved beneath it without
    following a link). Files and listed directories get the archive's permission bits;
    a parent the archive does not list gets ``dir_mode`` (None: 0777 less the umask).
    Returns {files, dirs, links, bytes}."""
    os.makedirs(dest, exist_ok=True)
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    n = {"files": 0, "dirs": 0, "links": 0, "bytes": 0}
    dirs: list[tuple[list[str], int]] = []
    try:
        for m, rel in members:
            parts = rel.split("/")
            parent = _walk(root, parts[:-1], mode=dir_mode)
            name = parts[-1]
            try:
                if m.isdir():
                    if not _clear(parent, name, for_dir=True):
                        os.mkdir(name, 0o700, dir_fd=parent)
                    dirs.append((parts, m.mode & 0o777))
                    n["dirs"] += 1
                    continue
                _clear(parent, name, for_dir=False)
                if m.issym():
                    os.symlink(m.linkname, name, dir_fd=parent)
                    n["links"] += 1
                elif m.islnk():
                    src = _clean(m.linkname).split("/")
                    sparent = _walk(root, src[:-1], create=False)
                    try:
                        os.link(src[-1], name, src_dir_fd=sparent, dst_dir_fd=parent,
                                follow_symlinks=False)
                    finally:
                        os.close(sparent)
                    n["links"] += 1
                else:
                    n["bytes"] += _write_file(tf, m, parent, name, chunk)
                    n["files"] += 1
            finally:
                os.close(parent)
        for parts, mode in reversed(dirs):  # last: a read-only directory was filled first
            fd = _walk(root, parts, create=False)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return n


def _write_file(tf: tarfile.TarFile, m: tarfile.TarInfo, parent: int, name: str,
                chunk: int) -> int:
    src = tf.extractfile(m)
    if src is None:
        raise Refused(f"entry {m.name!r} has no data")
    fd = os.open(name, FILE_CREATE, 0o600, dir_fd=parent)
    left, wrote = m.size, 0
    try:
        os.set_blocking(fd, True)
        while left > 0:
            b = src.read(min(chunk, left))
            if not b:
                raise Refused(f"entry {m.name!r} is cut short")
            left -= len(b)
            view = memoryview(b)
            while view:
                view = view[os.write(fd, view):]
            wrote += len(b)
        os.fchmod(fd, m.mode & 0o777)
        os.utime(fd, (m.mtime, m.mtime))
    finally:
        os.close(fd)
    return wrote


def extract(archive: str, dest: str) -> dict[str, Any]:
    """Extract the tar (optionally compressed) at archive into dest (created): every member
    checked first, then written beneath dest; {files, dirs, links, bytes}."""
    with tarfile.open(archive, "r:*") as tf:
        members = check_members(tf)
        return extract_members(tf, members, dest)


# ---- checking a stream as it arrives -------------------------------------------------------
_EXT_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
              tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


def _pax_records(data: bytes) -> dict[str, str]:
    """A pax extended header's records ("LEN key=value\\n"...)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos:pos + 1] not in (b"", b"\0"):
        sp = data.find(b" ", pos, pos + 24)
        if sp < 0 or not data[pos:sp].isdigit():
            raise Refused("malformed pax header")
        length = int(data[pos:sp])
        rec = data[sp + 1:pos + length]
        if length <= sp - pos or pos + length > len(data) or not rec.endswith(b"\n") \
                or b"=" not in rec:
            raise Refused("malformed pax header")
        k, v = rec[:-1].split(b"=", 1)
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        pos += length
    return out


class TarScanner:
    """The members of a tar stream, checked as its bytes are fed in (only headers are
    kept, never data): names, kinds and link targets as ``check_members`` checks one
    member, the running sum of the files' sizes against ``max_bytes`` (``TooBig`` at the
    first header that passes it), the count against ``max_members``. It is a gate in front
    of a spool, not the check of record: the complete archive still goes through
    ``check_members`` before anything is written."""

    def __init__(self, *, max_bytes: int | None = None, max_members: int = MAX_MEMBERS,
                 links: bool = True) -> None:
        self.max_bytes, self.max_members, self.links = max_bytes, max_members, links
        self.members = 0
        self.declared = 0  # bytes of file data the headers so far announce
        self.ended = False
        self._buf = bytearray()
        self._skip = 0  # data bytes (with padding) still to pass over
        self._ext: tuple[bytes, int] | None = None  # (type, bytes) of a pending extension
        self._pax: dict[str, str] = {}
        self._gpax: dict[str, str] = {}
        self._long: dict[bytes, str] = {}

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self.ended:
            if self._skip:
                k = min(self._skip, len(view))
                self._skip -= k
                view = view[k:]
                continue
            need = self._ext[1] if self._ext else BLOCK
            k = min(need - len(self._buf), len(view))
            self._buf += view[:k]
            view = view[k:]
            if len(self._buf) < need:
                return
            block = bytes(self._buf)
            self._buf.clear()
            if self._ext:
                self._extension(block)
            else:
                self._header(block)

    def close(self) -> None:
        """The stream ended: the archive must be whole."""
        if not self.ended and (self._buf or self._skip or self._ext or self.members == 0):
            raise Refused("the archive is cut short")

    def _extension(self, data: bytes) -> None:
        assert self._ext is not None
        kind = self._ext[0]
        self._ext = None
        self._skip = -len(data) % BLOCK
        if kind in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
            self._long[kind] = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            return
        recs = _pax_records(data)
        if any(k.startswith("GNU.sparse.") for k in recs):
            raise Refused("the archive has a sparse file")
        (self._gpax if kind == tarfile.XGLTYPE else self._pax).update(recs)

    def _header(self, block: bytes) -> None:
        if not block.strip(b"\0"):
            self.ended = True  # a zero block: the end (what follows is padding)
            return
        try:
            m = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise Refused(f"not a tar archive (after {self.members} entries): {e}") from None
        if m.type in _EXT_TYPES:
            if m.size > MAX_EXTENSION:
                raise Refused(f"an extended header of {m.size} bytes (at most "
                              f"{MAX_EXTENSION})")
            self._ext = (m.type, m.size)
            if m.size == 0:
                self._extension(b"")
            return
        pax = {**self._gpax, **self._pax}
        self._pax = {}
        long_name = self._long.pop(tarfile.GNUTYPE_LONGNAME, None)
        long_link = self._long.pop(tarfile.GNUTYPE_LONGLINK, None)
        m.name = pax.get("path", long_name if long_name is not None else m.name)
        m.linkname = pax.get("linkpath", long_link if long_link is not None else m.linkname)
        if "size" in pax:
            try:
                m.size = int(pax["size"])
            except ValueError:
                raise Refused(f"entry {m.name!r}: bad size {pax['size']!r}") from None
        if m.size < 0:
            raise Refused(f"entry {m.name!r}: negative size")
        self.members += 1
        if self.members > self.max_members:
            raise Refused(f"more than {self.max_members} entries")
        if _clean(m.name):
            check_type(m, self.links)
        if m.isreg():
            self.declared += m.size
            if self.max_bytes is not None and self.declared > self.max_bytes:
                raise TooBig(f"the archive holds more than {self.max_bytes} bytes (entry "
                             f"{m.name!r} declares {m.size})", self.max_bytes)
        if m.isreg() or m.type not in tarfile.SUPPORTED_TYPES:
            self._skip = m.size + (-m.size % BLOCK)


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
