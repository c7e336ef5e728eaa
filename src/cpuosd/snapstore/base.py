"""The snapshot store's interface: where checkpoint directories (a paused sandbox's image,
a fork's, a template's) are kept so that any node can restore them.

A snapshot is a directory of regular files (runsc's checkpoint.img, pages, the agent's key,
cpuos-snapshot.json: cpuosd.snapstore.facts) stored under a key (a sandbox id, or a
template's name and digest). A store keeps, beside the files, a manifest: each file's path,
size and (where the store is not the node's own disk) SHA-256, and the snapshot's facts, so
that placement can read them without fetching the image, and a download is checked whole
before anything restores it. A put is atomic: the manifest names a complete set of files or
the key is absent (a reader never sees half a snapshot, also while one is replaced); a put or
get cancelled part way leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

KEY_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
MANIFEST = "cpuos-manifest.json"
# keys of a fork's transfer images (cpuosd.lifecycle.snapshots: ``fork-<sandbox>-<hex>``),
# needed for one fork only: the sweep removes those older than its bound
FORK_PREFIX = "fork-"
MAX_FILES = 4096  # files in one snapshot (runsc writes a handful)
HASH_CHUNK = 1 << 20


class SnapshotError(Exception):
    """A snapshot that cannot be stored or fetched (named in the message)."""


class SnapshotMissing(SnapshotError):
    pass


class SnapshotCorrupt(SnapshotError):
    """A fetched file whose size or digest is not the manifest's."""


def check_key(key: str) -> str:
    if not KEY_RE.fullmatch(key):
        raise ValueError(f"snapshot key {key!r} must match {KEY_RE.pattern}")
    return key


def check_relpath(p: str) -> str:
    """A file's path inside a snapshot, as a manifest (from a shared store: not trusted)
    gives it: relative, normalized, no ``..``, not the manifest's own name."""
    pp = PurePosixPath(p)
    if (not p or p.startswith("/") or "\\" in p or "\x00" in p or str(pp) != p
            or any(part in ("", ".", "..") for part in pp.parts) or p == MANIFEST
            or len(p) > 1024):
        raise SnapshotCorrupt(f"the manifest names an unsafe path {p[:200]!r}")
    return p


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX
    size: int
    sha256: str | None  # None where the store does not check digests (the node's own disk)


@dataclass(frozen=True)
class Manifest:
    key: str
    files: tuple[FileEntry, ...]
    meta: dict[str, Any] = field(default_factory=dict)  # the snapshot's facts
    created_at: float = 0.0
    version: str = ""  # which upload of the key this is (the S3 store's object prefix)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        return json.dumps({"format": 1, "key": self.key, "version": self.version,
                           "created_at": self.created_at, "meta": self.meta,
                           "files": [{"path": f.path, "size": f.size, "sha256": f.sha256}
                                     for f in self.files]}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> Manifest:
        try:
            d = json.loads(data)
            files = tuple(FileEntry(check_relpath(str(f["path"])), int(f["size"]),
                                    None if f.get("sha256") is None else str(f["sha256"]))
                          for f in d["files"])
            if d.get("key") != key or len(files) > MAX_FILES or any(f.size < 0 for f in files):
                raise ValueError("not this key's manifest, or out of bounds")
            if len({f.path for f in files}) != len(files):
                raise ValueError("a path named twice")
            return cls(key, files, dict(d.get("meta") or {}), float(d.get("created_at") or 0),
                       str(d.get("version") or ""))
        except SnapshotCorrupt:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise SnapshotCorrupt(f"snapshot {key}: unreadable manifest: {e}") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def walk(src: Path) -> Iterator[tuple[str, Path, int]]:
    """(relative path, path, size) of each regular file under ``src``; anything else (a
    link, a device) is refused: a snapshot is files."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames
                                         if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):
                raise SnapshotError(f"{p} is not a regular file: a snapshot holds files only")
            rel = p.relative_to(src).as_posix()
            if rel == MANIFEST:
                continue
            n += 1
            if n > MAX_FILES:
                raise SnapshotError(f"{src} holds more than {MAX_FILES} files")
            yield rel, p, st.st_size


def read_facts(src: Path) -> dict[str, Any]:
    from .facts import read_meta

    return read_meta(src) or {}


def manifest_of(key: str, src: Path, *, digests: bool, version: str = "") -> Manifest:
    files = tuple(FileEntry(rel, size, sha256_file(p) if digests else None)
                  for rel, p, size in walk(src))
    return Manifest(key, files, read_facts(src), time.time(), version)


def check_file(path: Path, entry: FileEntry, key: str) -> None:
    """A fetched file against its manifest entry (SnapshotCorrupt if not it)."""
    size = path.stat().st_size
    if size != entry.size:
        raise SnapshotCorrupt(f"snapshot {key}: {entry.path} is {size} bytes, the manifest "
                              f"says {entry.size}")
    if entry.sha256 is not None and sha256_file(path) != entry.sha256:
        raise SnapshotCorrupt(f"snapshot {key}: {entry.path} does not match its SHA-256")


class SnapshotStore(Protocol):
    """Where snapshots are kept: ``local`` (this node's disk), ``shared`` (a directory all
    nodes mount) or ``s3`` (S3-compatible object storage)."""

    kind: str

    async def put(self, key: str, src: Path, *, move: bool = False) -> Manifest:
        """Store the directory ``src`` under ``key`` (replacing what was there, atomically);
        with ``move`` the store may take ``src`` itself (then it is gone)."""
        ...

    async def get(self, key: str, dest: Path) -> Manifest:
        """Fetch ``key`` into ``dest`` (which must not exist; made whole or not at all),
        every file checked against the manifest. SnapshotMissing if absent."""
        ...

    async def manifest(self, key: str) -> Manifest | None: ...
    async def exists(self, key: str) -> bool: ...
    async def size(self, key: str) -> int | None: ...
    async def delete(self, key: str) -> None: ...

    def local_path(self, key: str) -> Path | None:
        """A directory a restore may read ``key`` from as it is, without a copy (the
        node's own store), else None."""
        ...
