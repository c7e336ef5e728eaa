"""Snapshots in a directory: the node's own (``local``, the default: ``$CPUOS_HOME/snapshots``,
where runsc restores from without a copy) or one every node mounts (``shared``: NFS, a
cluster filesystem; fetched to local disk and checked by SHA-256 before a restore).

``<root>/<key>/`` holds the snapshot's files and its manifest. A put is written beside it
(``<root>/.incoming-<key>-<random>``) and renamed into place; a replaced one is renamed
away first and removed after (rename is atomic in one filesystem, NFS included). Names
starting with a dot are never keys (cpuosd.snapstore.base.KEY_RE), so these never collide.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .base import (FORK_PREFIX, MANIFEST, Manifest, SnapshotError, SnapshotMissing,
                   check_file, check_key, manifest_of, walk)

T = TypeVar("T")
COPY_CHUNK = 8 << 20


class Cancelled(Exception):
    pass


async def run_cancellable(fn: Callable[[threading.Event], T]) -> T:
    """``fn(cancel)`` in a thread; if the awaiting task is cancelled, ``cancel`` is set and
    the thread's end (its clean-up) is waited for before the cancellation goes on."""
    cancel = threading.Event()
    fut = asyncio.get_running_loop().run_in_executor(None, fn, cancel)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(BaseException):
            await asyncio.shield(fut)
        raise


def _copy(src: Path, dst: Path, cancel: threading.Event) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(src, "rb") as fi, os.fdopen(fd, "wb") as fo:
        while chunk := fi.read(COPY_CHUNK):
            if cancel.is_set():
                raise Cancelled
            fo.write(chunk)


class DirectorySnapshotStore:
    def __init__(self, root: Path, *, shared: bool = False) -> None:
        self.root = root
        self.shared = shared
        self.kind = "shared" if shared else "local"
        root.mkdir(parents=True, exist_ok=True)

    def _dir(self, key: str) -> Path:
        return self.root / check_key(key)

    def local_path(self, key: str) -> Path | None:
        d = self._dir(key)
        return d if not self.shared and d.is_dir() else None

    # ---- put ------------------------------------------------------------------------
    async def put(self, key: str, src: Path, *, move: bool = False) -> Manifest:
        check_key(key)
        return await run_cancellable(lambda cancel: self._put(key, src, move, cancel))

    def _put(self, key: str, src: Path, move: bool, cancel: threading.Event) -> Manifest:
        dest = self._dir(key)
        tmp = self.root / f".incoming-{key}-{secrets.token_hex(4)}"
        try:
            if move and os.stat(src).st_dev == os.stat(self.root).st_dev:
                os.rename(src, tmp)
            else:
                tmp.mkdir(mode=0o700)
                for rel, p, _ in list(walk(src)):
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    _copy(p, tmp / rel, cancel)
                if move:
                    shutil.rmtree(src, ignore_errors=True)
            if cancel.is_set():
                raise Cancelled
            m = manifest_of(key, tmp, digests=self.shared)
            if cancel.is_set():
                raise Cancelled
            fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(m.to_json())
            self._swap_in(tmp, dest)
            return m
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _swap_in(self, tmp: Path, dest: Path) -> None:
        old = None
        if dest.exists():
            old = self.root / f".old-{dest.name}-{secrets.token_hex(4)}"
            os.rename(dest, old)
        os.rename(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    # ---- get ------------------------------------------------------------------------
    async def get(self, key: str, dest: Path) -> Manifest:
        check_key(key)
        return await run_cancellable(lambda cancel: self._get(key, dest, cancel))

    def _get(self, key: str, dest: Path, cancel: threading.Event) -> Manifest:
        src = self._dir(key)
        m = self._manifest(key)
        if m is None:
            raise SnapshotMissing(f"snapshot {key} is not in the {self.kind} store")
        if dest.exists():
            raise SnapshotError(f"{dest} exists already")
        tmp = dest.with_name(f".{dest.name}.fetch-{secrets.token_hex(4)}")
        try:
            tmp.mkdir(mode=0o700, parents=False)
            for f in m.files:
                (tmp / f.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                try:
                    _copy(src / f.path, tmp / f.path, cancel)
                except FileNotFoundError:
                    raise SnapshotMissing(f"snapshot {key}: {f.path} is gone (replaced or "
                                          "deleted meanwhile)") from None
                check_file(tmp / f.path, f, key)
            os.rename(tmp, dest)
            return m
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # ---- the rest -------------------------------------------------------------------
    def _manifest(self, key: str) -> Manifest | None:
        d = self._dir(key)
        try:
            data = (d / MANIFEST).read_bytes()
        except FileNotFoundError:
            if not self.shared and d.is_dir():  # (an image written before manifests)
                return manifest_of(key, d, digests=False)
            return None
        return Manifest.from_json(data, key)

    async def manifest(self, key: str) -> Manifest | None:
        return await asyncio.to_thread(self._manifest, key)

    async def exists(self, key: str) -> bool:
        return await self.manifest(key) is not None

    async def size(self, key: str) -> int | None:
        m = await self.manifest(key)
        return None if m is None else m.total_bytes

    async def delete(self, key: str) -> None:
        d = self._dir(key)

        def rm() -> None:
            gone = self.root / f".old-{key}-{secrets.token_hex(4)}"
            try:
                os.rename(d, gone)  # (atomically absent, then removed)
            except FileNotFoundError:
                return
            shutil.rmtree(gone, ignore_errors=True)

        await asyncio.to_thread(rm)

    def sweep(self, older_than: float = 3600.0) -> list[str]:
        """Remove what puts, fetches and deletes that never finished (a daemon killed in
        the middle) left in the store: ``.incoming-*`` and ``.old-*`` older than
        ``older_than`` seconds. The names removed."""
        out, now = [], time.time()
        for p in self.root.iterdir():
            if p.name.startswith((".incoming-", ".old-")):
                with contextlib.suppress(OSError):
                    if now - p.lstat().st_mtime > older_than:
                        shutil.rmtree(p, ignore_errors=True)
                        out.append(p.name)
            elif p.name.startswith(FORK_PREFIX) and p.is_dir() and not p.is_symlink():
                # a fork's image its fork did not release (an API process that died)
                try:
                    m = self._manifest(p.name)
                    made = m.created_at if m is not None else p.lstat().st_mtime
                except (OSError, SnapshotError, ValueError):
                    made = p.lstat().st_mtime
                if now - made > older_than:
                    gone = self.root / f".old-{p.name}-{secrets.token_hex(4)}"
                    with contextlib.suppress(OSError):
                        os.rename(p, gone)
                        shutil.rmtree(gone, ignore_errors=True)
                        out.append(p.name)
        return out
